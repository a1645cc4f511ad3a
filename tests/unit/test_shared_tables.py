"""The draft's checks on the shards of a shared table (draft_server.shared_tables), without a target."""

from __future__ import annotations

import pytest
import torch

from draft_server.shared_tables import SharedTableError, collect_table
from tandem.parallel.vocab import shard_table
from tandem.wire.codec import AssembledTensor, ShardOf

VOCAB = 333  # not a multiple of 64: tp 2 pads it to 384, shards of 192 rows


def pieces(table: torch.Tensor, tp: int) -> list[AssembledTensor]:
    return [
        AssembledTensor("lm_head", ShardOf(rank, tp, table.shape[0]), shard_table(table, tp, rank))
        for rank in range(tp)
    ]


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_shards_in_any_order_reassemble_the_table(tp: int) -> None:
    table = torch.randn(VOCAB, 8)
    received = list(reversed(pieces(table, tp)))
    shared = collect_table("lm_head", received)
    assert torch.equal(shared.full(), table)
    assert [shard.shape[0] for shard in shared.shards] == [{1: 384, 2: 192, 3: 128}[tp]] * tp


@pytest.mark.parametrize(("source_tp", "consumer_tp"), [(2, 1), (1, 2), (2, 4), (3, 2)])
def test_reshard_for_another_tp_cuts_by_the_same_rule(source_tp: int, consumer_tp: int) -> None:
    table = torch.randn(VOCAB, 4)
    shared = collect_table("embed_tokens", pieces(table, source_tp))
    resharded = shared.shards_for(consumer_tp)
    assert len(resharded) == consumer_tp
    for rank, shard in enumerate(resharded):
        assert torch.equal(shard, shard_table(table, consumer_tp, rank))


def test_missing_shard_is_named() -> None:
    with pytest.raises(SharedTableError, match=r"lm_head: shards \[1\] of 2 never arrived"):
        collect_table("lm_head", pieces(torch.randn(VOCAB, 4), 2)[:1])


def test_duplicate_shard_is_refused() -> None:
    received = pieces(torch.randn(VOCAB, 4), 2)
    with pytest.raises(SharedTableError, match="shard 0 arrived twice"):
        collect_table("lm_head", [received[0], received[0], received[1]])


def test_shard_cut_by_another_rule_is_refused() -> None:
    # A plain split of the unpadded table (ceil(333 / 2) = 167 rows) instead of the padded vocab-parallel rule.
    table = torch.randn(VOCAB, 4)
    received = [AssembledTensor("lm_head", ShardOf(rank, 2, VOCAB), part) for rank, part in enumerate(table.split(167))]
    with pytest.raises(SharedTableError, match=r"shard 0 has shape \[167, 4\]; .* gives \[192, 4\]"):
        collect_table("lm_head", received)


def test_shards_disagreeing_on_the_table_are_refused() -> None:
    received = pieces(torch.randn(VOCAB, 4), 2)
    other = AssembledTensor("lm_head", ShardOf(1, 2, VOCAB + 1), received[1].tensor)
    with pytest.raises(SharedTableError, match="shard 1 says 2 shards of a vocabulary of 334"):
        collect_table("lm_head", [received[0], other])
