"""Adaptive k through a real `tandem serve`: with a draft that is rarely right (a random head), the orchestrator soon
stops drafting (k = 0) instead of paying for drafts nobody accepts, still drafts one round in EXPLORE_EVERY so that
acceptance stays measured, and the draft replica joins the rows of the rounds it was not asked about. Once k is 0 for
a batch of several requests, all of them but one leave the replica and decode target-only. Outputs stay those of
target-only decoding and the replica is never at fault."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from orchestrator.loop.speculation import EXPLORE_EVERY
from tests.integration.stack import Stack, generate, serve, service_addresses
from tests.integration.test_separate_services import scrape, value
from tests.integration.test_serving import wait_until_idle

NEW_TOKENS = 120  # with k = 0, 4 tokens a step (--num-scheduler-steps): enough steps to explore


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    with serve(
        llama_target, random_draft, "--speculative-num-steps", "3", "--adaptive-k", "--http-port", "0"
    ) as running:
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


def test_at_k_zero_a_batch_leaves_its_replica_but_for_one_probe(stack: Stack) -> None:
    """Four requests at once: their batch size is measured at full k, settles at 0, and then three of them are taken
    off the replica (no hidden rows any more, several tokens a step) while the oldest keeps k measured."""
    prompts = [[1, 40 + seed, 42, 99, 5, 70 + seed] for seed in range(4)]
    expected = [
        generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, disable_speculation=True)
        for p in prompts
    ]
    metrics = f"{stack.http_url}/metrics"
    before = value(scrape(metrics), "tandem:speculation_paused_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        completions = list(
            pool.map(
                lambda p: generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True), prompts
            )
        )
    assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
    assert value(scrape(metrics), "tandem:speculation_paused_total") - before == len(prompts) - 1
    assert sum(c.stats.draft_tokens for c in completions) > 0  # measured at full k before pausing
    assert not any("demoted" in line for line in stack.log)
    target, draft = wait_until_idle(service_addresses(stack.log))
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)
