"""orchestrator.batching.plan_step on hand-built requests: decoding first with room for drafts, the newest running
request preempted when the pool is short, prompt chunks under the token budget, admission in arrival order."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.batching import ActiveRequest, KVPool, plan_step
from orchestrator.output import RequestOutput
from orchestrator.settings import SchedulerSettings
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.validation import ValidatedRequest
from tandem.sampling.params import SamplingParams
from tests.helpers.tokenizer import write_tokenizer

POOL = KVPool(num_blocks=6, block_size=4)
SETTINGS = SchedulerSettings(num_steps=3, max_num_seqs=4, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def request(
    tokenizer: PreTrainedTokenizerBase, name: str, prompt: int, generated: int = 0, replica: str | None = "d"
) -> ActiveRequest:
    """A request with a prompt of `prompt` tokens that has generated `generated` tokens, all but the last with KV."""
    params = ValidatedRequest(tuple(range(3, 3 + prompt)), 64, SamplingParams(), (), True, False)
    output = RequestOutput(prompt, 64, True, IncrementalDetokenizer(tokenizer, params.input_ids), StopStringMatcher(()))
    output.generated.extend([5] * generated)
    active = ActiveRequest(name, params, output, replica, opened=generated > 0)
    active.kv_length = prompt + generated - 1 if generated else 0
    return active


def test_decoding_first_then_a_chunk_and_an_admission(tokenizer: PreTrainedTokenizerBase) -> None:
    # A decodes: kv 9 of 10 tokens, 1 + 3 rows -> positions 9..12: blocks 3 -> 4 (1 block). 2 free after A.
    decoding = request(tokenizer, "A", prompt=8, generated=2)
    waiting = deque([request(tokenizer, "B", prompt=20), request(tokenizer, "C", prompt=3)])
    plan = plan_step([decoding], waiting, POOL, SETTINGS)
    assert [(s.request.request_id, s.num_tokens, s.max_drafts) for s in plan.decode] == [("A", 1, 3)]
    # B's first chunk is the 4 tokens left of the budget: 1 block, leaving 1, a block of headroom for A. C waits:
    # the budget is spent, and it may not overtake B anyway.
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("B", 4)]
    assert [r.request_id for r in plan.admitted] == ["B"] and plan.preempted == []
    # One block fewer: after A's block none would be left beside B's chunk, so B waits.
    plan = plan_step([decoding], waiting, KVPool(num_blocks=5, block_size=4), SETTINGS)
    assert [s.request.request_id for s in plan.decode] == ["A"]
    assert plan.admitted == [] and plan.chunks == []


def test_the_newest_running_request_is_preempted_for_an_older_one(tokenizer: PreTrainedTokenizerBase) -> None:
    old = request(tokenizer, "old", prompt=8, generated=4)  # kv 11: 3 blocks; verify to 15: 4 blocks
    new = request(tokenizer, "new", prompt=8, generated=4)  # 3 blocks
    tight = KVPool(num_blocks=6, block_size=4)
    plan = plan_step([old, new], deque(), tight, SETTINGS)
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [s.request.request_id for s in plan.decode] == ["old"]


def test_a_request_alone_in_a_short_pool_preempts_itself(tokenizer: PreTrainedTokenizerBase) -> None:
    alone = request(tokenizer, "alone", prompt=8, generated=4)
    plan = plan_step([alone], deque(), KVPool(num_blocks=3, block_size=4), SETTINGS)
    assert plan.preempted == [alone] and plan.decode == []


def test_the_token_budget_splits_a_long_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    long = request(tokenizer, "long", prompt=30)
    plan = plan_step([], deque([long]), KVPool(num_blocks=32, block_size=4), SETTINGS)
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("long", 8)]
    long.kv_length = 24
    plan = plan_step([long], deque(), KVPool(num_blocks=32, block_size=4), SETTINGS)
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("long", 6)]  # the final chunk


def test_prefills_that_fill_the_pool_preempt_the_newest_for_the_oldest(tokenizer: PreTrainedTokenizerBase) -> None:
    older, newer = request(tokenizer, "older", prompt=16), request(tokenizer, "newer", prompt=16)
    older.kv_length = newer.kv_length = 8  # 2 blocks each: the pool of 4 is full, neither can take a chunk
    plan = plan_step([older, newer], deque(), KVPool(num_blocks=4, block_size=4), SETTINGS)
    assert plan.preempted == [newer]
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("older", 8)]
