"""min_tokens masking and logprobs of committed tokens: on hand-built logits, then in TargetRunner on a tiny real
checkpoint, where speculative verification must give what target-only decoding gives."""

from __future__ import annotations

import pytest
import torch

from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.scored_rows import token_logprobs
from target_server.items import ItemStatus, OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_runners import CACHE, PROMPT, full_forward, greedy_from_scratch


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    return load_target(write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec()))


def test_logprobs_are_the_raw_log_softmax_of_each_row() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))  # [3, vocab 50]
    entries = token_logprobs(logits, [7, 11], top=4)  # two tokens: the third row is not used
    expected = torch.log_softmax(logits, dim=-1)
    assert [entry.token_id for entry in entries] == [7, 11]
    for row, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(expected[row, entry.token_id]), abs=1e-6)
        best = expected[row].topk(4)
        assert [token for token, _ in entry.top] == best.indices.tolist()
        assert [value for _, value in entry.top] == pytest.approx(best.values.tolist(), abs=1e-6)
    assert token_logprobs(logits, [3], top=0)[0].top == ()


def greedy_masked(target: LlamaForCausalLM, stop: int, min_tokens: int, num_new: int) -> list[int]:
    """Greedy decoding from scratch with `stop` masked for the first min_tokens new tokens."""
    tokens = list(PROMPT)
    for index in range(num_new):
        logits, _ = full_forward(target, tokens)
        row = logits[-1].clone()
        if index < min_tokens:
            row[stop] = float("-inf")
        tokens.append(int(row.argmax()))
    return tokens[len(PROMPT) :]


def test_min_tokens_masks_greedy_and_verification_alike(target: LlamaForCausalLM) -> None:
    unmasked = greedy_from_scratch(target, PROMPT, 6)[len(PROMPT) :]
    stop = unmasked[0]  # the token greedy decoding would choose first
    min_tokens = 4
    expected = greedy_masked(target, stop, min_tokens, 6)
    assert expected[0] != stop
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=(stop,))

    target_only = TargetRunner(target, CACHE, max_context=64)
    tokens = target_only.prefill("a", PROMPT, params).new_tokens
    while len(tokens) < 6:
        tokens += target_only.verify("a").new_tokens
    assert tokens == expected

    speculative = TargetRunner(target, CACHE, max_context=64)
    first = speculative.prefill("a", PROMPT, params).new_tokens
    # A draft of the stop token where it is masked is rejected, and the correction is the masked argmax.
    rejected = speculative.verify("a", [stop, *expected[2:4]])
    assert (rejected.accepted, rejected.new_tokens) == (0, [expected[1]])
    accepted = speculative.verify("a", expected[2:5])
    assert accepted.accepted == 3
    assert [*first, *rejected.new_tokens, *accepted.new_tokens] == expected[:6]


def test_logprobs_of_accepted_drafts_equal_a_plain_forward(target: LlamaForCausalLM) -> None:
    reference = greedy_from_scratch(target, PROMPT, 6)
    n = len(PROMPT)
    runner = TargetRunner(target, CACHE, max_context=64)
    (opened,) = runner.step([StepItem("a", n, open=OpenRequest(PROMPT, SamplingParams()), top_logprobs=3)])
    (verified,) = runner.step([StepItem("a", 1, DraftTree.chain(reference[n + 1 : n + 4]), top_logprobs=3)])
    assert verified.accepted == 3
    logits, _ = full_forward(target, reference)
    expected = torch.log_softmax(logits, dim=-1)  # row i predicts token i + 1
    entries = [*opened.logprobs, *verified.logprobs]
    assert [entry.token_id for entry in entries] == reference[n : n + 5]
    for offset, entry in enumerate(entries):
        row = expected[n - 1 + offset]
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the most likely one
        assert [token for token, _ in entry.top] == row.topk(3).indices.tolist()
    (plain,) = runner.step([StepItem("a", 1)])
    assert plain.logprobs == []


def test_top_logprobs_beyond_the_bound_are_refused(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    (result,) = runner.step([StepItem("a", len(PROMPT), open=OpenRequest(PROMPT, SamplingParams()), top_logprobs=21)])
    assert result.status is ItemStatus.INVALID
    assert result.message.startswith("top_logprobs: 21")
    assert runner.requests == {} and runner.cache.num_free_blocks == CACHE.num_blocks
