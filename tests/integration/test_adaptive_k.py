"""Adaptive k through a real `tandem serve`: with a draft that is rarely right (a random head), the orchestrator soon
stops drafting (k = 0) instead of paying for drafts nobody accepts, and the draft replica joins the rows of the
rounds it was not asked about. Once k is 0 for a batch of several requests, all of them but one leave the replica and
decode target-only; once the classes are measured, new requests whose drafts would not pay start without one. Rounds
are counted by request class and k. Outputs stay those of target-only decoding and the replica is never at fault.

The tests share one stack and run in order: the first meets it fresh."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integration.stack import Stack, generate, serve, service_addresses
from tests.integration.test_separate_services import scrape, value
from tests.integration.test_serving import wait_until_idle

NEW_TOKENS = 120  # with k = 0, 4 tokens a step (--num-scheduler-steps): enough steps to explore


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    # At DEBUG the orchestrator logs each change of a request's k with the estimates behind it.
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("TANDEM_LOG_LEVEL", "debug")
        with serve(
            llama_target, random_draft, "--speculative-num-steps", "3", "--adaptive-k", "--http-port", "0"
        ) as running:
            yield running


def test_at_k_zero_a_batch_leaves_its_replica_but_for_one_probe(stack: Stack) -> None:
    """Four requests at once on the fresh stack, one of them constrained by a JSON schema: their batch size is
    measured at full k, settles at 0, and then three of them are taken off the replica (no hidden rows any more,
    several tokens a step) while the oldest keeps k measured. The JSON request's rounds count under class grammar."""
    prompts = [[1, 40 + seed, 42, 99, 5, 70 + seed] for seed in range(4)]
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    requests = [
        {"input_ids": p, "max_new_tokens": NEW_TOKENS, "ignore_eos": i < 3, "json_schema": schema if i == 3 else ""}
        for i, p in enumerate(prompts)
    ]
    expected = [generate(stack.address, **request, disable_speculation=True) for request in requests]
    metrics = f"{stack.http_url}/metrics"
    before = scrape(metrics)
    with ThreadPoolExecutor(len(requests)) as pool:
        completions = list(pool.map(lambda request: generate(stack.address, **request), requests))
    after = scrape(metrics)
    assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
    paused = "tandem:speculation_paused_total"
    assert value(after, paused) - value(before, paused) == len(prompts) - 1
    assert sum(c.stats.draft_tokens for c in completions) > 0  # measured at full k before pausing
    rounds = "tandem:draft_length_rounds_total"
    grammar = [value(after, rounds, request_class="grammar", k=str(k)) for k in range(4)]
    assert 0 < sum(grammar) <= completions[3].stats.rounds and grammar[3] > 0, grammar  # full k while measuring
    assert not any("demoted" in line for line in stack.log)
    # Why each request's k moved: "k 3 -> 0 of 3; acceptance by position ...; expected N tok/s (M without drafts)".
    stopped = [line for line in stack.log if re.search(r"DEBUG .*: k 3 -> 0 of 3; acceptance by position", line)]
    assert stopped and all(re.search(r"expected \d+ tok/s \(\d+ without drafts\)", line) for line in stopped)
    idle_again(stack)


def test_once_measured_a_request_whose_drafts_do_not_pay_starts_without_a_replica(stack: Stack) -> None:
    """After the first test the random head's acceptance is known for every class. A first request alone measures
    the costs of a batch of one (if they are not yet); then, one at a time, each request starts paused (counted in
    tandem:speculation_paused), drafts nothing and decodes several tokens a step."""
    prompts = [[1, 17 + seed, 42, 99, 5, 23 + seed] for seed in range(4)]
    expected = [
        generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, disable_speculation=True)
        for p in prompts
    ]
    first = generate(stack.address, input_ids=prompts[0], max_new_tokens=NEW_TOKENS, ignore_eos=True)
    metrics = f"{stack.http_url}/metrics"
    before = value(scrape(metrics), "tandem:speculation_paused_total")
    later = [generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts[1:]]
    assert [c.token_ids for c in [first, *later]] == [e.token_ids for e in expected]
    assert value(scrape(metrics), "tandem:speculation_paused_total") - before == len(later)
    assert sum(c.stats.draft_tokens for c in later) == 0
    assert all(c.stats.rounds < NEW_TOKENS / 2 for c in later)  # several tokens a step
    assert not any("demoted" in line for line in stack.log)
    idle_again(stack)


def idle_again(stack: Stack) -> None:
    target, draft = wait_until_idle(service_addresses(stack.log))
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)
