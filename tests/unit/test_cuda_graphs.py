"""Decode-shaped steps replayed from recorded shapes (tandem.layers.cuda_graphs), on the CPU.

The CUDA graph itself needs a GPU (tests/cuda); everything around it runs here through a recorder that replays by
running the forward again (tests.helpers.eager_recorder): the batch sizes, the padding into the scratch block, the
static buffers and the per-step attention plan, inside the real runners, whose tokens must not change.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from draft_server.runner import DraftRunner, ProposeInput
from draft_server.standalone_runner import StandaloneRunner
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.cuda_graphs import batch_sizes, pad_table
from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.models.eagle3 import load_eagle3
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings
from target_server.items import StepItem, StepResult
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import (
    TinyEagle3Spec,
    TinyTargetSpec,
    target_ids_of_draft,
    write_tiny_eagle3,
    write_tiny_target,
)
from tests.helpers.eager_recorder import EagerGraphs
from tests.helpers.target_rows import random_rows

BLOCK_SIZE = 4
PLAIN = KVCacheSettings(num_blocks=64, block_size=BLOCK_SIZE)
GRAPHED = KVCacheSettings(num_blocks=64, block_size=BLOCK_SIZE, cuda_graphs=True)
PROMPTS = {"a": [1, 40, 41, 42, 43, 44, 45], "b": [1, 50, 51], "c": [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]}
CAPTURE = (1, 2, 3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


def test_batch_sizes() -> None:
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(12) == [1, 2, 4, 8, 12]
    assert batch_sizes(1) == [1]


def test_the_scratch_block_is_never_handed_out() -> None:
    cache = PagedKVCache(1, 4, BLOCK_SIZE, 1, 8, torch.float32, scratch_block=True)
    sequence = SequenceKV()
    cache.reserve(sequence, 4 * BLOCK_SIZE)
    assert cache.scratch_block == 4 and sorted(sequence.block_ids) == [0, 1, 2, 3]
    assert cache.keys.shape[1] == 5 * BLOCK_SIZE and cache.num_blocks == 4
    with pytest.raises(OutOfKVBlocks):
        cache.reserve(SequenceKV(), 1)


def test_padding_goes_to_the_scratch_block() -> None:
    cache = PagedKVCache(1, 8, BLOCK_SIZE, 1, 8, torch.float32, scratch_block=True)
    a, b = SequenceKV(), SequenceKV()
    cache.plan_table([(a, 5), (b, 2)])
    table = cache.plan_table([(a, 2), (b, 2)])  # a: positions 5, 6; b: positions 2, 3

    padded = pad_table(table, 4, 8)

    assert padded.qo_indptr.tolist() == [0, 2, 4, 6, 8]
    assert padded.kv_indptr.tolist() == [*table.kv_indptr.tolist(), 4, 5]
    assert padded.kv_page_indices.tolist() == [*table.kv_page_indices.tolist(), 8, 8]
    assert padded.kv_last_page_len.tolist() == [*table.kv_last_page_len.tolist(), 2, 2]
    assert padded.positions.tolist() == [5, 6, 2, 3, 0, 1, 0, 1]
    # Block 8's slots are 32..35: the padding writes its first two, whatever the real sequences hold.
    assert padded.write_slots.tolist() == [*table.write_slots.tolist(), 32, 33, 32, 33]
    assert pad_table(table, 2, 8) is table
    with pytest.raises(ValueError, match="cannot pad 2 sequences to 1"):
        pad_table(table, 1, 8)


def test_padding_does_not_change_the_real_rows(target_dir: Path) -> None:
    model = load_target(target_dir)
    config = model.config
    cache = PagedKVCache(
        config.num_layers, 16, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32, scratch_block=True
    )
    a, b = SequenceKV(), SequenceKV()
    with torch.inference_mode():
        prompt = cache.plan([(a, 6), (b, 3)])
        model(torch.tensor([1, 40, 41, 42, 43, 44, 1, 50, 51]), prompt, cache)
        table = cache.plan_table([(a, 3), (b, 3)])
        ids = torch.tensor([45, 46, 47, 52, 53, 54])
        plain = model(ids, AttentionMetadata.planned(table, cache.backend), cache, CAPTURE)
        padded = pad_table(table, 4, cache.scratch_block)
        padded_ids = torch.cat((ids, torch.zeros(6, dtype=torch.long)))
        again = model(padded_ids, AttentionMetadata.planned(padded, cache.backend), cache, CAPTURE)
    torch.testing.assert_close(again.normed[:6], plain.normed, rtol=1e-5, atol=1e-5)
    for index in CAPTURE:
        torch.testing.assert_close(again.captured[index][:6], plain.captured[index], rtol=1e-5, atol=1e-5)


def run_rounds(runner: TargetRunner, drafts: dict[str, list[list[int]]]) -> list[list[StepResult]]:
    """Prefills every prompt, then per round one step of all requests: a verification of the round's drafts (all
    of one length), then a 3-token decode."""
    steps = [[runner.prefill(request_id, prompt, SamplingParams(), CAPTURE) for request_id, prompt in PROMPTS.items()]]
    for round_index in range(len(drafts["a"])):
        steps.append(runner.step([StepItem(i, 1, DraftTree.chain(drafts[i][round_index])) for i in PROMPTS]))
        steps.append(runner.step([StepItem(i, 1, decode_steps=3) for i in PROMPTS]))
    return steps


def test_target_runner_replays_the_same_tokens(target_dir: Path) -> None:
    reference = TargetRunner(load_target(target_dir), PLAIN, max_context=64)
    continuation = {}
    for request_id, prompt in PROMPTS.items():
        reference.prefill(request_id, prompt, SamplingParams())
        continuation[request_id] = [reference.verify(request_id).new_tokens[0] for _ in range(3)]
    # Right drafts for a (after its first token), wrong ones for b, half right for c; then 2-draft rounds.
    drafts = {
        "a": [[*continuation["a"][1:3], 5], [9, 9]],
        "b": [[7, 8, 9], [continuation["b"][0], 3]],
        "c": [[continuation["c"][1], 4, 4], [6, 6]],
    }
    graphs = EagerGraphs()
    graphed = TargetRunner(load_target(target_dir), GRAPHED, max_context=64, graphs=graphs)
    plain = TargetRunner(load_target(target_dir), PLAIN, max_context=64)

    expected, got = run_rounds(plain, drafts), run_rounds(graphed, drafts)

    assert [[(r.status, r.accepted, r.new_tokens) for r in step] for step in got] == [
        [(r.status, r.accepted, r.new_tokens) for r in step] for step in expected
    ]
    assert any(result.accepted > 0 for step in got for result in step)
    for step, expected_step in zip(got, expected, strict=True):
        for result, expected_result in zip(step, expected_step, strict=True):
            assert result.captured is not None and expected_result.captured is not None
            torch.testing.assert_close(result.captured.features, expected_result.captured.features)
    recorder = graphs.recorder
    assert recorder is not None
    # Three requests run at batch size 4: a shape for 3 drafts (q 4), one for decoding (q 1), one for 2 drafts.
    assert recorder.recorded == [4, 4, 4]
    assert recorder.replays == 2 * (1 + 3)  # per round: the verification and the decode's 3 passes
    blocks = sum(len(request.kv.block_ids) for request in graphed.requests.values())
    assert graphed.cache.num_free_blocks == PLAIN.num_blocks - blocks  # the scratch block is not in the pool


def test_steps_that_are_not_decode_shaped_run_as_planned(target_dir: Path) -> None:
    graphs = EagerGraphs()
    runner = TargetRunner(load_target(target_dir), GRAPHED, max_context=64, graphs=graphs)
    for request_id, prompt in PROMPTS.items():
        runner.prefill(request_id, prompt, SamplingParams())
    runner.step([StepItem("a", 1, DraftTree.chain([5, 6])), StepItem("b", 1, DraftTree.chain([7]))])  # q 3 and q 2
    runner.step([StepItem("a", 1, DraftTree((5, 6), (-1, -1)))])  # a tree
    assert graphs.recorder is not None and graphs.recorder.recorded == []


def test_a_shape_that_cannot_be_recorded_runs_eagerly(target_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    graphs = EagerGraphs(fail=True)
    runner = TargetRunner(load_target(target_dir), GRAPHED, max_context=64, graphs=graphs)
    plain = TargetRunner(load_target(target_dir), PLAIN, max_context=64)
    with caplog.at_level(logging.WARNING, logger="tandem.layers.cuda_graphs"):
        for each in (runner, plain):
            each.prefill("a", PROMPTS["a"], SamplingParams())
        got = [runner.step([StepItem("a", 1, decode_steps=3)]).pop().new_tokens for _ in range(2)]
        expected = [plain.step([StepItem("a", 1, decode_steps=3)]).pop().new_tokens for _ in range(2)]
    assert got == expected
    assert graphs.recorder is not None and graphs.recorder.recorded == [1]  # tried once, then eager
    assert [r.getMessage() for r in caplog.records] == ["cannot record a CUDA graph of (1, 1, ()): it runs eagerly"]


def test_draft_runner_replays_the_same_proposals(tmp_path: Path, target_dir: Path) -> None:
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    draft_dir = write_tiny_eagle3(tmp_path / "draft", target_dir, spec)
    graphs = EagerGraphs()
    graphed = DraftRunner(load_eagle3(draft_dir)[0], GRAPHED, graphs=graphs)
    plain = DraftRunner(load_eagle3(draft_dir)[0], PLAIN)
    # c's options lift one token far above the others (draft_server.shaping): the steps replayed from a recorded
    # shape hand out their logits, shaped outside the replay.
    lifted = target_ids_of_draft(draft_dir)[5]
    options = Shaping(SamplingParams(logit_bias=((lifted, 50.0),)), 1, (1, *random_rows(0, 9, seed=4).next_tokens))
    batches = [
        [ProposeInput("a", random_rows(0, 6, seed=1), 4), ProposeInput("b", random_rows(0, 3, seed=2), 2)],
        [ProposeInput("a", random_rows(7, 2, seed=3), 5), ProposeInput("c", random_rows(0, 9, seed=4), 5, options)],
    ]
    proposals = []
    for batch in batches:
        proposals.append(graphed.propose(batch))
        assert proposals[-1] == plain.propose(batch)
    assert proposals[1][1] == [lifted] * 5 and proposals[1][0] != [lifted] * 5
    assert graphs.recorder is not None
    assert graphs.recorder.recorded == [2, 1]  # both requests, then a alone (b stops at 2 steps)
    assert graphs.recorder.replays == 1 + 2 + 4  # first batch: one step of 2, two of 1; second: four of 2


def test_standalone_runner_replays_the_same_proposals(target_dir: Path) -> None:
    graphs = EagerGraphs()
    graphed = StandaloneRunner(load_target(target_dir), GRAPHED, graphs=graphs)
    plain = StandaloneRunner(load_target(target_dir), PLAIN)
    batch = [ProposeInput("a", random_rows(-1, 6, seed=5, width=0), 4), ProposeInput("b", random_rows(-1, 4, 6, 0), 4)]
    assert graphed.propose(batch) == plain.propose(batch)
    assert graphs.recorder is not None and graphs.recorder.recorded == [2]
    assert graphs.recorder.replays == 3
