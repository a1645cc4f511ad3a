"""A target started with `tandem target --tp N` streams its embedding and LM head as vocab-parallel shards, and a
draft-side client reassembles them exactly (draft_server.shared_tables)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from draft_server.shared_tables import SharedTable, pull_tables
from tandem.grpc_util import channel_options
from tandem.parallel.vocab import shard_table
from tandem.wire import target_pb2_grpc
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.integration.stack import target_process

VOCAB = 333  # not a multiple of 64


async def pull(address: str) -> dict[str, SharedTable]:
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        # 1000-byte chunks: every shard spans many chunks.
        return await pull_tables(target_pb2_grpc.TargetStub(channel), ["embed_tokens", "lm_head"], chunk_bytes=1000)


@pytest.fixture(scope="module")
def llama_odd_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyTargetSpec(family="llama", vocab_size=VOCAB, num_layers=2)
    return write_tiny_target(tmp_path_factory.mktemp("odd-vocab"), spec)


@pytest.fixture(scope="module")
def gemma_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma"), TinyGemma3Spec())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_shards_round_trip(family: str, tp: int, llama_odd_vocab: Path, gemma_tied: Path, tmp_path: Path) -> None:
    model = llama_odd_vocab if family == "llama" else gemma_tied
    tensors = load_file(str(model / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    # Gemma3's LM head is its (raw, unscaled) embedding; the target slices it by the same vocab-parallel rule.
    head = tensors.get("lm_head.weight", embedding)
    with target_process(model, tp, tmp_path / "ready") as target:
        tables = asyncio.run(pull(target.address))
    for name, expected in (("embed_tokens", embedding), ("lm_head", head)):
        table = tables[name]
        assert table.vocab_size == expected.shape[0]
        assert len(table.shards) == tp
        for rank, shard in enumerate(table.shards):
            assert torch.equal(shard, shard_table(expected, tp, rank)), (name, rank)
        assert torch.equal(table.full(), expected)
        for rank, shard in enumerate(table.shards_for(2)):
            assert torch.equal(shard, shard_table(expected, 2, rank))
