"""The target's and the draft's model runners on tiny real checkpoints, plus the draft/target compatibility check.

TargetRunner is checked against greedy decoding recomputed from scratch (fresh cache per token), so that its KV
truncation after rejected drafts cannot hide behind itself. DraftRunner is checked against direct calls of the draft
model on its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from draft_server.compat import IncompatibleDraft, check_compatibility
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput, TargetRows
from tandem.layers import matmul
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.eagle3 import Eagle3Draft, load_eagle3
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from target_server.items import TARGET_ONLY, ItemStatus, OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import (
    TinyEagle3Spec,
    TinyTargetSpec,
    target_ids_of_draft,
    write_tiny_eagle3,
    write_tiny_target,
)
from tests.helpers.target_rows import random_rows

GREEDY = SamplingParams()
BLOCK_SIZE = 4
CACHE = KVCacheSettings(num_blocks=64, block_size=BLOCK_SIZE)
PROMPT = [1, 40, 41, 42, 43, 44, 45]  # 7 tokens: the prefill ends inside the second block
CAPTURE = (4, 1, 2)  # deliberately not sorted: features are concatenated in the request's order
HIDDEN = 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture(scope="module")
def target(target_dir: Path) -> LlamaForCausalLM:
    return load_target(target_dir)


@pytest.fixture(scope="module")
def reference_tokens(target: LlamaForCausalLM) -> list[int]:
    """PROMPT followed by 12 greedy tokens."""
    return greedy_from_scratch(target, PROMPT, 12)


def full_forward(
    model: LlamaForCausalLM, token_ids: Sequence[int], capture: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [n, vocab], features [n, len(capture) * hidden]
    """One forward of the whole sequence on a fresh cache."""
    config = model.config
    cache = PagedKVCache(config.num_layers, 32, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = cache.plan([(SequenceKV(), len(token_ids))])
    with torch.no_grad():
        output = model(torch.tensor(list(token_ids)), metadata, cache, capture)
        logits = model.compute_logits(output.normed)
    features = torch.cat([output.captured[index] for index in capture], dim=-1) if capture else torch.empty(0)
    return logits, features


def greedy_from_scratch(model: LlamaForCausalLM, prompt: Sequence[int], num_new: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_new):
        logits, _ = full_forward(model, tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens


def start(runner: TargetRunner, request_id: str = "a", capture: tuple[int, ...] = CAPTURE) -> int:
    """Prefills PROMPT and returns the first generated token."""
    result = runner.prefill(request_id, PROMPT, GREEDY, capture)
    return result.new_tokens[0]


def blocks_for(length: int) -> int:
    return -(-length // BLOCK_SIZE)


# TargetRunner.


def test_prefill_returns_first_token_and_captured_rows(target: LlamaForCausalLM, reference_tokens: list[int]) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    result = runner.prefill("a", PROMPT, GREEDY, CAPTURE)

    first = reference_tokens[len(PROMPT)]
    assert (result.accepted, result.new_tokens) == (0, [first])
    request = runner.requests["a"]
    assert request.tokens == [*PROMPT, first]
    assert request.kv.length == len(PROMPT) == len(request.tokens) - 1
    assert CACHE.num_blocks - runner.cache.num_free_blocks == blocks_for(len(PROMPT))

    captured = result.captured
    assert captured is not None
    assert captured.start_position == 0
    # Row p pairs the features of position p with the token after it.
    assert captured.next_tokens == [*PROMPT[1:], first]
    _, expected = full_forward(target, PROMPT, CAPTURE)
    assert captured.features.shape == (len(PROMPT), len(CAPTURE) * HIDDEN)
    assert (captured.features - expected).abs().max().item() <= 1e-5


def test_all_drafts_accepted_plus_bonus(target: LlamaForCausalLM, reference_tokens: list[int]) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    start(runner)
    n = len(PROMPT)  # KV length before the round
    drafts = reference_tokens[n + 1 : n + 4]  # the target's own greedy continuation, k = 3

    result = runner.verify("a", drafts)

    assert result.accepted == 3
    assert result.new_tokens == reference_tokens[n + 1 : n + 5]  # 3 drafts and the bonus
    request = runner.requests["a"]
    assert request.kv.length == n + 4  # advanced by k + 1
    assert request.tokens == reference_tokens[: n + 5]
    captured = result.captured
    assert captured is not None
    assert (captured.start_position, captured.next_tokens) == (n, result.new_tokens)
    _, expected = full_forward(target, reference_tokens[: n + 4], CAPTURE)
    assert (captured.features - expected[n : n + 4]).abs().max().item() <= 1e-5


def test_wrong_first_draft_accepts_nothing_and_truncates(target: LlamaForCausalLM, reference_tokens: list[int]) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    start(runner)
    n = len(PROMPT)
    correct = reference_tokens[n + 1]
    wrong = (correct + 1) % 320
    free_before = runner.cache.num_free_blocks

    # 6 drafts take the KV to n + 7 positions (4 blocks) during the pass; only n + 1 survive.
    result = runner.verify("a", [wrong, *reference_tokens[n + 2 : n + 7]])

    assert (result.accepted, result.new_tokens) == (0, [correct])
    request = runner.requests["a"]
    assert request.kv.length == n + 1
    assert request.tokens == reference_tokens[: n + 2]
    assert runner.cache.num_free_blocks == free_before - (blocks_for(n + 1) - blocks_for(n))
    captured = result.captured
    assert captured is not None
    assert (captured.start_position, captured.next_tokens) == (n, [correct])
    assert captured.features.shape == (1, len(CAPTURE) * HIDDEN)


def test_partial_acceptance_keeps_output_equal_to_plain_decoding(
    target: LlamaForCausalLM, reference_tokens: list[int]
) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    start(runner, capture=())
    # Each round: how many leading drafts are right, and how many drafts in all (the rest are wrong).
    rounds = [(2, 4), (0, 3), (1, 1), (3, 3), (0, 0)]
    for right, total in rounds:
        tokens = runner.requests["a"].tokens
        position = len(tokens)
        drafts = reference_tokens[position : position + right]
        drafts += [(token + 7) % 320 for token in reference_tokens[position + right : position + total]]

        result = runner.verify("a", drafts)

        assert result.accepted == right
        assert result.new_tokens == reference_tokens[position : position + right + 1]
        assert result.captured is None
        assert runner.requests["a"].kv.length == len(runner.requests["a"].tokens) - 1
    assert runner.requests["a"].tokens == reference_tokens[: len(runner.requests["a"].tokens)]
    assert len(runner.requests["a"].tokens) == len(PROMPT) + 1 + sum(right + 1 for right, _ in rounds)


def test_batched_verify_matches_separate_requests(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    prompts = {"a": PROMPT, "b": [1, 90, 91], "c": [1, 7, 8, 9, 10, 11, 12, 13, 14, 15]}
    references = {request_id: greedy_from_scratch(target, prompt, 6) for request_id, prompt in prompts.items()}
    opened = runner.step(
        [
            StepItem(request_id, len(prompt), open=OpenRequest(prompt, GREEDY), stream=TARGET_ONLY)
            for request_id, prompt in prompts.items()
        ]
    )
    assert all(result.status is ItemStatus.OK for result in opened)

    first = runner.step(
        [
            StepItem("a", 1, DraftTree.chain(references["a"][len(PROMPT) + 1 : len(PROMPT) + 4])),  # all 3 right
            StepItem("b", 1, DraftTree.chain([0, 0])),  # wrong
            StepItem("c", 1),  # plain decoding
        ]
    )

    assert [result.accepted for result in first] == [3, 0, 0]
    for request_id, prompt in prompts.items():
        tokens = runner.requests[request_id].tokens
        assert tokens == references[request_id][: len(tokens)]
        assert len(tokens) > len(prompt) + 1
    runner.release(["a", "b", "c"])
    assert runner.cache.num_free_blocks == CACHE.num_blocks
    assert runner.requests == {}


# DraftRunner.


@pytest.fixture(scope="module")
def draft_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    return write_tiny_eagle3(tmp_path_factory.mktemp("draft"), target_dir, spec)


@pytest.fixture(scope="module")
def draft(draft_dir: Path) -> Eagle3Draft:
    model, has_embedding = load_eagle3(draft_dir)
    assert has_embedding
    return model


def direct_proposal(model: Eagle3Draft, rows: TargetRows, num_steps: int) -> list[int]:
    """The draft chain computed with direct model calls on a fresh cache; rows must start at position 0."""
    layer = model.config.layer
    cache = PagedKVCache(1, 32, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim, torch.float32)
    sequence = SequenceKV()
    proposed = []
    with torch.no_grad():
        metadata = cache.plan([(sequence, len(rows.next_tokens))])
        step = model(torch.tensor(list(rows.next_tokens)), model.project_features(rows.features), metadata, cache)
        for index in range(num_steps):
            token = model.to_target_ids(step.logits[-1:].argmax(dim=-1))
            proposed.append(int(token))
            if index + 1 < num_steps:
                step = model(token, step.hidden[-1:], cache.plan([(sequence, 1)]), cache)
    return proposed


def concatenated(first: TargetRows, second: TargetRows) -> TargetRows:
    assert second.start_position == first.start_position + len(first.next_tokens)
    return TargetRows(
        first.start_position,
        [*first.next_tokens, *second.next_tokens],
        torch.cat([first.features, second.features]),
    )


def test_propose_ingests_rows_and_drafts_a_chain(draft: Eagle3Draft, draft_dir: Path) -> None:
    runner = DraftRunner(draft, CACHE)
    rows = random_rows(0, 6, seed=1)

    (proposal,) = runner.propose([ProposeInput("a", rows, num_steps=4)])

    assert proposal == direct_proposal(draft, rows, 4)
    assert set(proposal) <= set(target_ids_of_draft(draft_dir))
    # 6 ingested rows, then 3 speculative single-token steps (the first proposal comes from the ingest itself).
    assert runner.requests["a"].kv.length == 6 + 3


def test_next_ingest_truncates_speculative_kv(draft: Eagle3Draft) -> None:
    runner = DraftRunner(draft, CACHE)
    first, second = random_rows(0, 6, seed=2), random_rows(6, 2, seed=3)
    runner.propose([ProposeInput("a", first, num_steps=4)])  # KV up to 9, of which 6..8 speculative

    (proposal,) = runner.propose([ProposeInput("a", second, num_steps=3)])

    assert proposal == direct_proposal(draft, concatenated(first, second), 3)
    assert runner.requests["a"].kv.length == 8 + 2


def test_ingest_can_roll_back_to_an_earlier_position(draft: Eagle3Draft) -> None:
    # The target may resend rows the draft already ingested (e.g. after its own retry): they replace the old ones.
    runner = DraftRunner(draft, CACHE)
    first = random_rows(0, 6, seed=4)
    runner.propose([ProposeInput("a", first, num_steps=2)])
    replacement = random_rows(4, 3, seed=5)

    (proposal,) = runner.propose([ProposeInput("a", replacement, num_steps=2)])

    kept = TargetRows(0, first.next_tokens[:4], first.features[:4])
    assert proposal == direct_proposal(draft, concatenated(kept, replacement), 2)


def test_gap_in_rows_is_refused(draft: Eagle3Draft) -> None:
    runner = DraftRunner(draft, CACHE)
    runner.propose([ProposeInput("a", random_rows(0, 6, seed=6), num_steps=2)])  # KV up to 7
    with pytest.raises(DraftRequestError, match=r"'a': rows start at position 9 but the draft holds positions up to 7"):
        runner.propose([ProposeInput("a", random_rows(9, 2, seed=7), num_steps=2)])


def test_new_request_must_start_at_zero(draft: Eagle3Draft) -> None:
    runner = DraftRunner(draft, CACHE)
    with pytest.raises(DraftRequestError, match="rows start at position 3 but the draft holds positions up to 0"):
        runner.propose([ProposeInput("b", random_rows(3, 2, seed=8), num_steps=1)])


def test_refused_batch_changes_nothing(draft: Eagle3Draft) -> None:
    runner = DraftRunner(draft, CACHE)
    runner.propose([ProposeInput("a", random_rows(0, 6, seed=6), num_steps=2)])  # KV up to 7
    free_blocks = runner.cache.num_free_blocks
    batch = [ProposeInput("a", random_rows(3, 2, seed=7), num_steps=2), ProposeInput("b", random_rows(5, 2, seed=8), 1)]
    with pytest.raises(DraftRequestError, match="'b': rows start at position 5"):
        runner.propose(batch)
    assert runner.requests["a"].kv.length == 7
    assert "b" not in runner.requests
    assert runner.cache.num_free_blocks == free_blocks


def test_batched_requests_with_different_step_counts(draft: Eagle3Draft) -> None:
    runner = DraftRunner(draft, CACHE)
    rows = [random_rows(0, 5, seed=9), random_rows(0, 3, seed=10), random_rows(0, 7, seed=11)]
    num_steps = [2, 4, 3]

    proposals = runner.propose([ProposeInput(f"r{index}", rows[index], num_steps[index]) for index in range(len(rows))])

    assert [len(proposal) for proposal in proposals] == num_steps
    for index in range(len(rows)):
        assert proposals[index] == direct_proposal(draft, rows[index], num_steps[index])
        assert runner.requests[f"r{index}"].kv.length == len(rows[index].next_tokens) + num_steps[index] - 1
    runner.release(["r0", "r1", "r2"])
    assert runner.cache.num_free_blocks == CACHE.num_blocks


# Draft/target compatibility.


def target_info(hidden_size: int = 64, vocab_size: int = 320) -> target_pb2.TargetInfo:
    return target_pb2.TargetInfo(architecture="LlamaForCausalLM", hidden_size=hidden_size, vocab_size=vocab_size)


def test_compatible_draft_passes(draft: Eagle3Draft) -> None:
    check_compatibility(draft.config, target_info(), has_embedding=False)


def test_hidden_size_mismatch_names_both_values(draft: Eagle3Draft) -> None:
    with pytest.raises(IncompatibleDraft) as error:
        check_compatibility(draft.config, target_info(hidden_size=128), has_embedding=True)
    message = str(error.value)
    assert "target_hidden_size 64" in message
    assert "hidden_size 128" in message


def test_vocab_mismatch_names_both_values(draft: Eagle3Draft) -> None:
    with pytest.raises(IncompatibleDraft) as error:
        check_compatibility(draft.config, target_info(vocab_size=32000), has_embedding=True)
    message = str(error.value)
    assert "vocab_size 320" in message
    assert "vocab_size 32000" in message


def test_draft_of_another_width_needs_its_own_embedding(target_dir: Path, tmp_path: Path) -> None:
    spec = TinyEagle3Spec(hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=8)
    config = load_eagle3(write_tiny_eagle3(tmp_path, target_dir, spec))[0].config
    check_compatibility(config, target_info(), has_embedding=True)
    with pytest.raises(IncompatibleDraft, match="hidden_size 96 differs from the target's hidden_size 64"):
        check_compatibility(config, target_info(), has_embedding=False)


def test_the_runners_give_every_linear_of_their_model_onednn_s_copy(
    target: LlamaForCausalLM, draft: Eagle3Draft
) -> None:
    if not matmul.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN")
    TargetRunner(target, CACHE, max_context=64)
    DraftRunner(draft, CACHE)
    for model in (target, draft):
        linears = [module for module in model.modules() if isinstance(module, matmul.Linear)]
        assert linears and all(module.prepacked is not None for module in linears)
