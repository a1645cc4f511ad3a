"""Tensor parallelism: the vocab-parallel padding rule, and tp 2 against tp 1 through the real models.

The tp-2 runs are real: rank 0 runs in a spawned process through the same start-up as `tandem target --tp 2`
(target_server.main.start_target), which starts rank 1 as `python -m target_server.rank`; they talk over gloo. Every
vocabulary here is not a multiple of 64, so the last rank's shard ends in padding rows. The Qwen3 checkpoint is fp8,
kept as stored on each rank (tandem.layers.stored), its pulled LM head served as floats; the DeepSeek-V3 one too, the
Kimi-K2.5 one keeps its experts in INT4.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DeepseekV3Config

from tandem.layers.kv_cache import SequenceKV
from tandem.models.registry import check_tensor_parallel
from tandem.parallel.group import ParallelismError
from tandem.parallel.vocab import (
    VocabShard,
    assemble_shards,
    padded_vocab,
    reshard,
    shard_rows,
    shard_table,
    vocab_shard,
)
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.main import start_target
from target_server.runner import TargetRunner
from target_server.settings import TargetSettings
from target_server.step import ForwardStep
from tests.helpers.checkpoints import TinyTargetSpec, read_target_tensor, write_tiny_target
from tests.helpers.deepseek_checkpoints import TinyDeepseekSpec, write_tiny_deepseek
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.helpers.kimi_checkpoints import write_tiny_kimi_k25
from tests.helpers.quantized_checkpoints import write_fp8, write_int4_experts
from tests.unit.test_deepseek_v3 import kimi_k2_config

TOLERANCE = 1e-4  # fp32, as the parity tests against transformers
CACHE = KVCacheSettings(num_blocks=64, block_size=4)
GREEDY = SamplingParams()
PROMPTS = ([1, 40, 41, 42, 43, 44, 45], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59])
RANK_TIMEOUT_S = 120.0

# The padding rule.


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("vocab", [32000, 128256, 151936, 50257])
def test_padding_rule_on_real_vocabularies(vocab: int, tp: int) -> None:
    padded = padded_vocab(vocab, tp)
    assert padded % 64 == 0 and padded % tp == 0
    assert vocab <= padded < vocab + 64 * tp
    assert shard_rows(vocab, tp) * tp == padded
    # REFERENCE.md: a plain ceil(V / tp) split of a replicated table agrees with the rule exactly when 64 divides V.
    assert (shard_rows(vocab, tp) == math.ceil(vocab / tp)) == (vocab % 64 == 0)


@pytest.mark.parametrize(
    ("vocab", "tp", "padded", "rows"),
    [
        (50257, 2, 50304, 25152),  # the worked example of tandem.parallel.vocab
        (1000, 2, 1024, 512),
        (1000, 3, 1152, 384),  # 1024 is not a multiple of 3: pad to a multiple of 64 * 3
        (333, 2, 384, 192),
        (333, 8, 384, 48),
        (333, 1, 384, 384),
    ],
)
def test_padding_rule_worked_cases(vocab: int, tp: int, padded: int, rows: int) -> None:
    assert (padded_vocab(vocab, tp), shard_rows(vocab, tp)) == (padded, rows)


def test_shards_at_the_end_of_the_vocabulary() -> None:
    assert vocab_shard(50257, 2, 1) == VocabShard(start=25152, rows=25152, real=25105)
    assert vocab_shard(333, 8, 6) == VocabShard(start=288, rows=48, real=45)
    assert vocab_shard(333, 8, 7) == VocabShard(start=336, rows=48, real=0)  # padding only


@pytest.mark.parametrize("vocab", [333, 1000])
@pytest.mark.parametrize("tp", [1, 2, 3, 8])
def test_shard_assemble_and_reshard_round_trip(vocab: int, tp: int) -> None:
    table = torch.randn(vocab, 5, generator=torch.Generator().manual_seed(vocab + tp))
    shards = [shard_table(table, tp, rank) for rank in range(tp)]
    rows = shard_rows(vocab, tp)
    for rank, shard in enumerate(shards):
        assert shard.shape == (rows, 5)
        start = rank * rows
        real = max(0, min(rows, vocab - start))
        assert torch.equal(shard[:real], table[start : start + real])
        assert not shard[real:].any(), "padding rows are zero"
    assert torch.equal(assemble_shards(shards, vocab), table)
    for new_tp in (1, 2, 3):
        expected = [shard_table(table, new_tp, rank) for rank in range(new_tp)]
        assert all(torch.equal(a, b) for a, b in zip(reshard(shards, vocab, new_tp), expected, strict=True))


def test_assembling_shards_cut_by_another_rule_is_refused() -> None:
    table = torch.randn(333, 4)
    plain_halves = list(table.split(math.ceil(333 / 2)))  # 167 + 166 rows: not the vocab-parallel rule
    with pytest.raises(ValueError, match="shard 0 has 167 rows; vocab 333 at tp 2 gives 192"):
        assemble_shards(plain_halves, 333)


# Refusals.


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "tp 3 does not divide num_attention_heads 4"),
        (4, "tp 4 does not divide num_key_value_heads 2"),
    ],
)
def test_tp_that_does_not_divide_the_heads_is_refused(tmp_path: Path, tp: int, message: str) -> None:
    target = write_tiny_target(tmp_path, TinyTargetSpec(num_heads=4, num_kv_heads=2, num_layers=1))
    with pytest.raises(ParallelismError, match=message):
        check_tensor_parallel(target, tp)


def test_deepseek_v3_refuses_a_tp_that_cuts_its_heads_or_units(tmp_path: Path) -> None:
    config = DeepseekV3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=34, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    check_tensor_parallel(tmp_path, 2)
    with pytest.raises(ParallelismError, match="tp 3 does not divide num_attention_heads 4"):
        check_tensor_parallel(tmp_path, 3)
    with pytest.raises(ParallelismError, match="tp 4 does not divide moe_intermediate_size 34"):
        check_tensor_parallel(tmp_path, 4)


# tp 2 against tp 1 through the real models.


def write_qwen2_tied(directory: Path) -> Path:
    # q/k/v biases (sliced per rank), a tied vocab-parallel table.
    return write_tiny_target(directory, TinyTargetSpec(family="qwen2", vocab_size=333, tie_word_embeddings=True))


def write_qwen3_fp8(directory: Path) -> Path:
    # q/k norms, separate embedding and LM head, a vocabulary that tp 2 splits into 512-row shards; every projection
    # and the LM head in 16 x 16 fp8 blocks, kept as stored: tp 2 splits each on a block boundary (the head's last rank
    # ends inside its last block, where the table ends). The reference dequantization lies beside it.
    source = write_tiny_target(directory / "float", TinyTargetSpec(family="qwen3", vocab_size=1000, num_layers=3))
    write_fp8(source, directory / "fp8", directory / "reference", (16, 16), head=True)
    return directory / "fp8"


def write_gemma3(directory: Path) -> Path:
    # A replicated tied table, cut by the rule only for weight_shards; o_proj's bias is added by rank 0 alone.
    write_tiny_gemma3(directory, TinyGemma3Spec(vocab_size=333, attention_bias=True))
    return directory


def write_deepseek_fp8(directory: Path) -> Path:
    # MLA (heads split, the latent cached whole on each rank) and MoE (each expert's units split, one all-reduce a
    # layer) in DeepSeek-V3's fp8 layout, 16 x 16 blocks kept as stored: tp 2 cuts every split on a block boundary.
    source = write_tiny_deepseek(directory / "float", TinyDeepseekSpec(num_layers=3))
    write_fp8(source, directory / "fp8", directory / "reference", (16, 16))
    return directory / "fp8"


def write_kimi_k2_fp8(directory: Path) -> Path:
    # The same fp8 layout under Kimi-K2's config.json (model_type kimi_k2, rope in the older form).
    checkpoint = write_deepseek_fp8(directory)
    config = checkpoint / "config.json"
    config.write_text(json.dumps(kimi_k2_config(json.loads(config.read_text()))))
    return checkpoint


def write_kimi_k25_int4(directory: Path) -> Path:
    # Kimi-K2.5's routed experts in compressed-tensors INT4, groups of 16 columns: tp 2 gives each rank one group of
    # every expert's down_proj.
    source = write_tiny_kimi_k25(directory / "float", TinyDeepseekSpec(num_layers=3))
    write_int4_experts(source, directory / "int4", directory / "reference", 16)
    return directory / "int4"


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "qwen2-tied": write_qwen2_tied,
    "qwen3-fp8": write_qwen3_fp8,
    "gemma3-tied": write_gemma3,
    "deepseek-fp8": write_deepseek_fp8,
    "kimi-k2-fp8": write_kimi_k2_fp8,
    "kimi-k25-int4": write_kimi_k25_int4,
}


def scenario(runner: TargetRunner) -> dict[str, Any]:
    """What both tp runs do, on rank 0: packed steps straight on the paged KV cache, greedy rounds through the
    runner, and the shared tables' shards.

    The steps: a prefill of two sequences, a verify-like step over their cached context (4 and 1 new tokens), then,
    after truncating two rejected rows of the first sequence, a step that writes over their slots.
    """
    model, cache = runner.model, runner.cache
    capture = tuple(range(model.config.num_layers + 1))
    sequences = [SequenceKV(), SequenceKV()]
    logits, streams = [], []
    for new_tokens in ([*PROMPTS], [[7, 8, 9, 10], [11]], [[12, 13, 14], [15, 16]]):
        if new_tokens[0] == [12, 13, 14]:
            cache.truncate(sequences[0], sequences[0].length - 2)
        metadata = cache.plan([(kv, len(tokens)) for kv, tokens in zip(sequences, new_tokens, strict=True)])
        input_ids = torch.tensor([token for tokens in new_tokens for token in tokens])
        step = ForwardStep(input_ids, metadata, capture, torch.arange(len(input_ids)))
        output, step_logits = runner.ranks.forward(model, cache, step)
        logits.append(step_logits)
        streams.append(torch.cat([output.captured[index] for index in capture], dim=-1))
    for kv in sequences:
        cache.release(kv)

    # Plain decoding finds the greedy continuation; a second request then drafts two of its tokens and a wrong one.
    first = runner.prefill("plain", PROMPTS[1], GREEDY, (1, 2))
    rounds = [first]
    for _ in range(3):
        rounds.append(runner.verify("plain"))
    greedy = [token for result in rounds for token in result.new_tokens]
    drafted_first = runner.prefill("drafted", PROMPTS[1], GREEDY, (1, 2))
    rounds += [drafted_first, runner.verify("drafted", [greedy[1], greedy[2], (greedy[3] + 1) % 300])]
    return {
        "logits": torch.cat(logits),
        "streams": torch.cat(streams),
        "tokens": [(result.accepted, result.new_tokens) for result in rounds],
        "features": torch.cat([result.captured.features for result in rounds if result.captured is not None]),
        "shards": {name: runner.weight_shards(name) for name in ("embed_tokens", "lm_head")},
    }


def run_rank_0(model_dirs: dict[str, Path], tp: int, out: Path) -> None:
    """A spawned process: rank 0 of `tp` ranks for each checkpoint in turn, started as `tandem target --tp` starts
    it; saves the scenario's results by checkpoint name."""
    os.environ["OMP_NUM_THREADS"] = "1"  # also for rank 1, which inherits the environment
    torch.set_num_threads(1)
    found = {}
    for name, model_dir in model_dirs.items():
        runner = start_target(TargetSettings(model_dir=model_dir, cache=CACHE, tp=tp))
        try:
            found[name] = scenario(runner)
        finally:
            runner.ranks.stop()
    torch.save(found, out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write(tmp_path_factory.mktemp(name)) for name, write in CHECKPOINTS.items()}


def scenario_at_tp2(checkpoints: dict[str, Path], out: Path) -> dict[str, Any]:
    """The scenario at tp 2 for every checkpoint (name -> directory), from one spawned rank 0 (its rank 1 restarts
    per checkpoint); `out` holds the results on the way back. Name -> the scenario's results."""
    process = multiprocessing.get_context("spawn").Process(target=run_rank_0, args=(checkpoints, 2, out))
    process.start()
    try:
        process.join(RANK_TIMEOUT_S)
    finally:
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0, f"rank 0 exited with {process.exitcode}"
    found: dict[str, Any] = torch.load(out)
    return found


@pytest.fixture(scope="module")
def results_at_tp2(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return scenario_at_tp2(checkpoints, tmp_path_factory.mktemp("tp2") / "scenario.pt")


@pytest.fixture(params=sorted(CHECKPOINTS))
def checkpoint_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def checkpoint(checkpoint_name: str, checkpoints: dict[str, Path]) -> Path:
    return checkpoints[checkpoint_name]


@pytest.fixture
def results(checkpoint_name: str, checkpoint: Path, results_at_tp2: dict[str, Any]) -> dict[int, Any]:
    """The scenario at tp 1 (in this process) and at tp 2 (two processes), for one checkpoint."""
    at_tp1 = scenario(start_target(TargetSettings(model_dir=checkpoint, cache=CACHE)))
    return {1: at_tp1, 2: results_at_tp2[checkpoint_name]}


def max_difference(first: torch.Tensor, second: torch.Tensor) -> float:
    assert first.shape == second.shape
    return (first - second).abs().max().item()


def test_tp2_logits_and_hidden_states_match_tp1(results: dict[int, dict[str, Any]]) -> None:
    assert results[2]["logits"].dtype == torch.float32
    assert max_difference(results[2]["logits"], results[1]["logits"]) <= TOLERANCE
    assert max_difference(results[2]["streams"], results[1]["streams"]) <= TOLERANCE


def test_tp2_runner_commits_the_same_tokens_as_tp1(results: dict[int, dict[str, Any]]) -> None:
    assert results[2]["tokens"] == results[1]["tokens"]
    drafted = results[1]["tokens"][-1]
    assert drafted[0] == 2, "the drafted round accepts two drafts and rejects the third"
    assert max_difference(results[2]["features"], results[1]["features"]) <= TOLERANCE


@pytest.mark.parametrize("name", ["embed_tokens", "lm_head"])
def test_weight_shards_reassemble_to_the_checkpoint_table(
    results: dict[int, dict[str, Any]], checkpoint: Path, name: str
) -> None:
    table = checkpoint_table(checkpoint, name)
    vocab = table.shape[0]
    for tp, found in results.items():
        shards = found["shards"][name]
        assert len(shards) == tp
        assert all(shard.shape == (shard_rows(vocab, tp), table.shape[1]) for shard in shards)
        assert torch.equal(assemble_shards(shards, vocab), table)
        assert not torch.cat(shards)[vocab:].any(), "padding rows are zero"


def checkpoint_table(checkpoint: Path, name: str) -> torch.Tensor:  # -> [vocab, hidden]
    """The table as the checkpoint stores it (a quantized one dequantized: its reference beside it); a tied checkpoint
    has no lm_head.weight, its head is the embedding."""
    reference = checkpoint.parent / "reference"
    checkpoint = reference if reference.is_dir() else checkpoint
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as handle:
        stored = set(handle.keys())
    untied_head = name == "lm_head" and any(key.endswith("lm_head.weight") for key in stored)
    wanted = "lm_head.weight" if untied_head else "model.embed_tokens.weight"
    [key] = [key for key in stored if key.endswith(wanted)]  # a multimodal checkpoint's are its language model's
    return read_target_tensor(checkpoint, key)


def test_an_fp8_qwen3_kept_as_stored_at_tp_2_decodes_as_transformers(
    checkpoints: dict[str, Path], results_at_tp2: dict[str, Any]
) -> None:
    # The plain request's prefill and three verifies, against transformers on the reference dequantization.
    reference = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3-fp8"].parent / "reference", dtype=torch.float32)
    greedy = [token for _, tokens in results_at_tp2["qwen3-fp8"]["tokens"][:4] for token in tokens]
    with torch.no_grad():
        generated = reference.eval().generate(
            torch.tensor([PROMPTS[1]]), do_sample=False, max_new_tokens=len(greedy), min_new_tokens=len(greedy)
        )
    assert greedy == generated[0, len(PROMPTS[1]) :].tolist()
