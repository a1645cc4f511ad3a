"""TargetRunner.step on a tiny real checkpoint: chunked prefill, preemption and recompute, and per-item failures
that leave every other item, and the KV pool, as if the bad item had not been sent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import MAX_DRAFT_TOKENS, TARGET_ONLY, ItemStatus, OpenRequest, RowStream, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_runners import BLOCK_SIZE, CAPTURE, GREEDY, PROMPT, full_forward, greedy_from_scratch

CACHE = KVCacheSettings(num_blocks=16, block_size=BLOCK_SIZE)
VOCAB = 320


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture(scope="module")
def target(target_dir: Path) -> LlamaForCausalLM:
    return load_target(target_dir)


def open_item(request_id: str, num_tokens: int, capture: tuple[int, ...] = CAPTURE) -> StepItem:
    return StepItem(request_id, num_tokens, open=OpenRequest(PROMPT, GREEDY), stream=RowStream(capture))


def test_chunked_prefill_gives_the_tokens_and_rows_of_a_whole_prefill(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    (first,) = runner.step([open_item("a", 3)])
    (second,) = runner.step([StepItem("a", 2)])
    (last,) = runner.step([StepItem("a", 2)])
    assert first.new_tokens == second.new_tokens == [] and first.status is second.status is ItemStatus.OK
    expected = greedy_from_scratch(target, PROMPT, 1)[-1]
    assert last.new_tokens == [expected]
    chunks = [result.captured for result in (first, second, last)]
    assert all(rows is not None for rows in chunks)
    features = torch.cat([rows.features for rows in chunks if rows is not None])
    next_tokens = [token for rows in chunks if rows is not None for token in rows.next_tokens]
    assert [rows.start_position for rows in chunks if rows is not None] == [0, 3, 5]
    assert next_tokens == [*PROMPT[1:], expected]
    _, reference = full_forward(target, PROMPT, CAPTURE)
    assert (features - reference).abs().max().item() <= 1e-5


def test_preempted_request_is_recomputed_from_its_tokens(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    reference = greedy_from_scratch(target, PROMPT, 8)
    runner.step([open_item("a", len(PROMPT), capture=())])
    for _ in range(3):
        runner.step([StepItem("a", 1)])
    tokens = list(runner.requests["a"].tokens)
    assert runner.step([], preempt=["a"]) == []
    assert runner.requests["a"].kv.length == 0 and runner.cache.num_free_blocks == CACHE.num_blocks
    # Recompute in two chunks; the last one reaches the last committed token and gives the next token.
    runner.step([StepItem("a", 6)])
    (resumed,) = runner.step([StepItem("a", len(tokens) - 6)])
    assert [*tokens, *resumed.new_tokens] == reference[: len(tokens) + 1]
    (following,) = runner.step([StepItem("a", 1, DraftTree.chain(reference[len(tokens) + 1 : len(tokens) + 3]))])
    assert runner.requests["a"].tokens == reference[: len(runner.requests["a"].tokens)]
    assert following.accepted == 2


def test_bad_items_fail_alone_and_change_nothing(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    runner.step([open_item("a", len(PROMPT)), open_item("b", len(PROMPT))])
    free = runner.cache.num_free_blocks
    states = {rid: (list(r.tokens), r.kv.length) for rid, r in runner.requests.items()}
    results = runner.step(
        [
            StepItem("a", 1, DraftTree.chain([VOCAB])),  # a draft id outside the vocabulary
            StepItem("b", 1, DraftTree.chain([5] * (MAX_DRAFT_TOKENS + 1))),  # too many drafts
            StepItem("c", 1),  # unknown request
            open_item("a", 2),  # already running
            StepItem("b", 3),  # more tokens than b has without KV
        ]
    )
    assert [r.status for r in results] == [ItemStatus.INVALID] * 5
    assert results[0].message == f"draft_tokens[0]: {VOCAB} is outside the vocabulary [0, {VOCAB})"
    assert results[1].message == f"draft_tokens: {MAX_DRAFT_TOKENS + 1}, at most {MAX_DRAFT_TOKENS}"
    assert {rid: (list(r.tokens), r.kv.length) for rid, r in runner.requests.items()} == states
    assert runner.cache.num_free_blocks == free
    # The same step with one good item: the good one runs, the bad one still changes nothing.
    good, bad = runner.step([StepItem("a", 1), StepItem("b", 1, DraftTree.chain([-1]))])
    assert good.status is ItemStatus.OK and len(good.new_tokens) == 1
    assert bad.status is ItemStatus.INVALID and runner.requests["b"].tokens == states["b"][0]


def test_an_item_without_kv_room_is_exhausted_and_the_others_run(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, KVCacheSettings(num_blocks=3, block_size=BLOCK_SIZE), max_context=64)
    first, second = runner.step([open_item("a", len(PROMPT)), open_item("b", len(PROMPT))])
    assert first.status is ItemStatus.OK
    assert second.status is ItemStatus.EXHAUSTED and "needs 2 more blocks, 1 free" in second.message
    assert "b" not in runner.requests
    assert runner.cache.num_free_blocks == 1


def test_a_failing_forward_returns_every_block(target: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    runner.step([open_item("a", len(PROMPT))])
    free, length = runner.cache.num_free_blocks, runner.requests["a"].kv.length

    def broken(*args: object) -> None:
        raise RuntimeError("the forward pass failed")

    monkeypatch.setattr(runner.ranks, "forward", broken)
    with pytest.raises(RuntimeError, match="the forward pass failed"):
        runner.step([StepItem("a", 1, DraftTree.chain([3, 4, 5])), open_item("b", len(PROMPT))])
    assert "b" not in runner.requests
    assert (runner.cache.num_free_blocks, runner.requests["a"].kv.length) == (free, length)


@pytest.mark.parametrize("temperature", [1e-40, 2e-38, 1e-30, 1e-8])
def test_tiny_temperatures_sample_the_argmax(target: LlamaForCausalLM, temperature: float) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    sampling = SamplingParams(temperature=temperature, seed=3)
    (result,) = runner.step([StepItem("a", len(PROMPT), open=OpenRequest(PROMPT, sampling), stream=TARGET_ONLY)])
    assert result.status is ItemStatus.OK
    assert result.new_tokens == [greedy_from_scratch(target, PROMPT, 1)[-1]]


def test_a_multi_token_decode_equals_one_token_steps(target: LlamaForCausalLM) -> None:
    """decode_steps 4: four forward passes in one step give the tokens, rows and logprobs of four one-token steps."""
    one, multi = (TargetRunner(target, CACHE, max_context=64) for _ in range(2))
    for runner in (one, multi):
        runner.step([open_item("a", len(PROMPT))])
    singles = [one.step([StepItem("a", 1, top_logprobs=2)])[0] for _ in range(4)]
    (joined,) = multi.step([StepItem("a", 1, top_logprobs=2, decode_steps=4)])
    assert joined.status is ItemStatus.OK and joined.accepted == 0
    assert joined.new_tokens == [token for result in singles for token in result.new_tokens]
    assert joined.new_tokens == greedy_from_scratch(target, PROMPT, 5)[len(PROMPT) + 1 :]
    assert [entry.token_id for entry in joined.logprobs] == joined.new_tokens
    assert joined.captured is not None
    assert joined.captured.start_position == len(PROMPT)
    assert joined.captured.next_tokens == joined.new_tokens
    expected = torch.cat([result.captured.features for result in singles if result.captured is not None])
    assert (joined.captured.features - expected).abs().max().item() <= 1e-5
    assert multi.requests["a"].kv.length == one.requests["a"].kv.length == len(PROMPT) + 4


def test_a_multi_token_decode_stops_after_an_end_token_or_without_kv_room(target: LlamaForCausalLM) -> None:
    prompt = [1, 7, 90, 200, 31, 5, 77]  # greedy: 202, 105, 288, 194, 308, ... (no repeats early on)
    reference = greedy_from_scratch(target, prompt, 6)[len(prompt) :]
    assert len(set(reference[:4])) == 4
    ending = OpenRequest(prompt, GREEDY, end_token_ids=frozenset({reference[3]}))
    runner = TargetRunner(target, CACHE, max_context=64)
    runner.step([StepItem("a", len(prompt), open=ending)])
    (result,) = runner.step([StepItem("a", 1, decode_steps=5)])
    assert result.new_tokens == reference[1:4]  # the end token is the last one decoded
    reference = greedy_from_scratch(target, PROMPT, 6)[len(PROMPT) :]
    # A pool of 3 blocks (12 positions) holds the prompt's 7 and 5 more: the decode ends at the pool, not in error.
    small = TargetRunner(target, KVCacheSettings(num_blocks=3, block_size=BLOCK_SIZE), max_context=64)
    small.step([open_item("a", len(PROMPT), capture=())])
    (result,) = small.step([StepItem("a", 1, decode_steps=10)])
    assert result.status is ItemStatus.OK and result.new_tokens == reference[1:6]
    assert small.cache.num_free_blocks == 0 and small.requests["a"].kv.length == 12


def test_a_request_reopened_with_its_generated_tokens_goes_on_where_it_was(target: LlamaForCausalLM) -> None:
    # What a restarted target is given (OpenRequest.generated): the same next tokens as the target that generated
    # them, because they count as generated for the penalties, not as prompt.
    penalised = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    first = TargetRunner(target, CACHE, max_context=64)
    first.step([StepItem("a", len(PROMPT), open=OpenRequest(PROMPT, penalised), stream=TARGET_ONLY)])
    for _ in range(5):
        first.step([StepItem("a", 1)])
    generated = first.requests["a"].tokens[len(PROMPT) :]
    following = [token for _ in range(3) for token in first.step([StepItem("a", 1)])[0].new_tokens]

    def reopened(opening: OpenRequest) -> list[int]:
        runner = TargetRunner(target, CACHE, max_context=64)
        (result,) = runner.step([StepItem("b", len(PROMPT) + len(generated), open=opening, stream=TARGET_ONLY)])
        return [*result.new_tokens, *(t for _ in range(2) for t in runner.step([StepItem("b", 1)])[0].new_tokens)]

    assert reopened(OpenRequest(PROMPT, penalised, generated=generated)) == following
    assert reopened(OpenRequest([*PROMPT, *generated], penalised)) != following  # the penalties see the difference


def test_a_reopened_request_past_the_context_or_outside_the_vocabulary_is_refused(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=16)
    too_long, bad_id = runner.step(
        [
            StepItem("a", 1, open=OpenRequest(PROMPT, GREEDY, generated=[5] * 9), stream=TARGET_ONLY),
            StepItem("b", 1, open=OpenRequest(PROMPT, GREEDY, generated=[5, VOCAB]), stream=TARGET_ONLY),
        ]
    )
    assert too_long.status is bad_id.status is ItemStatus.INVALID
    assert too_long.message == "prompt: 7 tokens and 9 generated, the context holds 16"
    assert "generated" in bad_id.message and str(VOCAB) in bad_id.message, bad_id.message
    assert not runner.requests and runner.cache.num_free_blocks == CACHE.num_blocks
