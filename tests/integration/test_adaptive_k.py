"""Adaptive k through a real `tandem serve`: with a draft that is rarely right (a random head), the orchestrator soon
stops drafting (k = 0) instead of paying for drafts nobody accepts, still drafts one round in EXPLORE_EVERY so that
acceptance stays measured, and the draft replica joins the rows of the rounds it was not asked about. Outputs stay
those of target-only decoding and the replica is never at fault."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.speculation import EXPLORE_EVERY
from tests.integration.stack import Stack, generate, serve, service_addresses
from tests.integration.test_serving import wait_until_idle

NEW_TOKENS = 120  # with k = 0, 4 tokens a step (--num-scheduler-steps): enough steps to explore


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    with serve(llama_target, random_draft, "--speculative-num-steps", "3", "--adaptive-k") as running:
        yield running


def test_a_draft_that_does_not_pay_stops_being_asked_and_outputs_stay_right(stack: Stack) -> None:
    prompts = [[1, 17 + seed, 42, 99, 5, 23 + seed] for seed in range(4)]
    expected = [
        generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, disable_speculation=True)
        for p in prompts
    ]
    completions = [generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]
    assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
    first, later = completions[0].stats, completions[1:]
    assert first.draft_tokens > 0  # k starts at --speculative-num-steps, which measures the draft
    rounds = sum(c.stats.rounds for c in later)
    drafted = sum(c.stats.draft_tokens for c in later)
    # Later rounds draft nothing, but for one round in EXPLORE_EVERY at full k.
    assert rounds > EXPLORE_EVERY
    assert 0 < drafted <= 3 * (rounds // EXPLORE_EVERY + 1), (drafted, rounds)
    assert not any("demoted" in line for line in stack.log)
    target, draft = wait_until_idle(service_addresses(stack.log))
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)
