"""The choice of each request's k (orchestrator.loop.draft_length) on acceptance the demo pair recorded round by
round per request class (tests/unit/data/acceptance_traces.json, written by `python -m bench.traces`), with costs
shaped like the demo pair's on 2 CPU cores."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from orchestrator.loop.draft_length import (
    EXPLORE_EVERY,
    FREE,
    GRAMMAR,
    PENALTIES,
    REQUEST_DECAY,
    Asking,
    Candidate,
    Choice,
    DraftLengths,
    Survival,
    allocate,
    group,
    rate_of,
    request_class,
)
from orchestrator.loop.speculation import MIN_PROPOSES
from tandem.sampling.params import SamplingParams

Trace = list[tuple[int, int]]  # (depth, accepted) of each round, recorded at k = 5
TRACES: dict[str, list[Trace]] = {
    name: [[(depth, accepted) for depth, accepted in trace] for trace in traces]
    for name, traces in json.loads((Path(__file__).parent / "data" / "acceptance_traces.json").read_text())[
        "traces"
    ].items()
}
HOP_SECONDS = 0.001


def target_seconds(rows: int) -> float:
    return 0.0046 + 0.00065 * rows


def draft_step_seconds(batch: int) -> float:
    return 0.0010 + 0.00015 * (batch - 1)


def measured(max_k: int = 5, draft_scale: float = 1.0) -> DraftLengths:
    """A policy whose costs are measured at every batch size up to 32 (its acceptance comes from the replays), the
    draft's scaled by `draft_scale`."""
    policy = DraftLengths(max_k)
    for rows in (1, 2, 4, 6, 8, 12, 24, 48, 96, 192):
        for _ in range(3):
            policy.costs.observe_target(rows, target_seconds(rows))
    for batch in (1, 2, 4, 8, 16, 32):
        compute = draft_scale * draft_step_seconds(batch) * (max_k + 1)
        for _ in range(MIN_PROPOSES):
            policy.costs.observe_propose(batch, max_k, draft_scale * HOP_SECONDS + compute, compute)
    return policy


Check = Callable[[Sequence[Asking], Choice], None]


def replay(
    policy: DraftLengths,
    requests: Sequence[tuple[str, Trace]],
    concurrency: int,
    check: Check | None = None,
    settled_k: bool = False,
) -> list[list[int]]:
    """Runs the recorded requests `concurrency` at a time: each step asks the policy for every running request's k
    (and hands what it asked and got to `check`) and feeds back what the request's next recorded round gives at that
    k (min(depth, k) drafted, min(accepted, k) accepted). Returns the k of each request's rounds (with `settled_k`,
    the settled ones: exploration aside)."""
    queue = list(enumerate(requests))
    running: dict[int, tuple[str, list[tuple[int, int]], Survival]] = {}
    chosen: list[list[int]] = [[] for _ in requests]
    settled: dict[int, int] = {}
    while queue or running:
        while queue and len(running) < concurrency:
            index, (name, trace) = queue.pop(0)
            running[index] = (name, list(trace), Survival(REQUEST_DECAY))
        asking = [Asking(str(i), name, own, 5, settled.get(i)) for i, (name, _, own) in running.items()]
        choice = policy.choose(len(running), asking)
        if check is not None:
            check(asking, choice)
        for index, (name, trace, own) in list(running.items()):
            k = choice.lengths[str(index)]
            settled[index] = choice.settled[str(index)]
            chosen[index].append(settled[index] if settled_k else k)
            depth, accepted = trace.pop(0)
            policy.observe_round(name, own, min(depth, k), min(accepted, k))
            if not trace:
                del running[index]
    return chosen


def class_survival(name: str) -> list[float]:
    """The class's recorded acceptance by position: the rounds that accepted at least j + 1 drafts."""
    rounds = [accepted for trace in TRACES[name] for depth, accepted in trace if depth == 5]
    return [sum(1 for accepted in rounds if accepted > j) / len(rounds) for j in range(5)]


def best_alone(policy: DraftLengths, survival: Sequence[float]) -> int:
    """The k with the most tokens per second for one request of this acceptance, by the policy's costs."""

    def rate(k: int) -> float:
        return (1 + sum(survival[:k])) / policy.costs.round_seconds(1, 1 + k, 1 if k else 0, k)

    return max(range(6), key=rate)


def test_a_request_class_is_the_constraint_its_drafts_are_verified_under() -> None:
    assert request_class(SamplingParams()) == FREE
    assert request_class(SamplingParams(temperature=0.7, top_p=0.9)) == FREE
    assert request_class(SamplingParams(presence_penalty=0.5)) == PENALTIES
    assert request_class(SamplingParams(repetition_penalty=1.2)) == PENALTIES
    assert request_class(SamplingParams(logit_bias=((7, -100.0),))) == PENALTIES
    assert request_class(SamplingParams(grammar="start: /[a-z]+/", frequency_penalty=0.5)) == GRAMMAR


def test_the_recorded_classes_differ_as_the_issue_says() -> None:
    """The demo head drafts free code well, JSON poorly past the tokens a grammar forces, penalised text between."""
    free, grammar, penalties = (class_survival(name) for name in (FREE, GRAMMAR, PENALTIES))
    assert free[0] > penalties[0] > grammar[0]
    assert sum(free) > 2.5 > sum(grammar)


def test_one_request_at_a_time_each_class_starts_at_what_pays_for_it_alone() -> None:
    """Free code, then JSON, then penalised requests, one at a time (the first four of each class learn it): once a
    class is known, each new request's first round drafts the k that is best for its class's recorded acceptance,
    and a class whose drafts never pay stays at 0 but for exploration."""
    policy = measured()
    for name in (FREE, GRAMMAR, PENALTIES):
        chosen = replay(policy, [(name, trace) for trace in TRACES[name]], 1, settled_k=True)
        best = best_alone(policy, class_survival(name))
        assert [ks[0] for ks in chosen[4:]] == [best] * (len(chosen) - 4), (name, best, chosen)
        if best == 0:
            later = [k for ks in chosen[4:] for k in ks]
            assert later.count(0) >= 0.95 * len(later), (name, later)
    assert [best_alone(policy, class_survival(name)) for name in (FREE, GRAMMAR)] == [5, 0]


def test_a_request_whose_drafts_stop_paying_stops_and_tries_again_at_a_bounded_cost() -> None:
    policy = measured()
    replay(policy, [(FREE, trace) for trace in TRACES[FREE][:4]], 1)  # the class is known and drafts fully
    good, bad = TRACES[FREE][4][:10], [(5, 0)] * 200
    (chosen,) = replay(policy, [(FREE, good + bad)], 1)
    stopped = chosen[10:].index(0)
    assert stopped <= 10, chosen[:30]  # its own rounds outweigh its class within a few rounds
    retries = sum(1 for k in chosen[10 + stopped :] if k > 0)
    assert 1 <= retries <= 200 // EXPLORE_EVERY + 1, chosen


def test_a_new_request_starts_from_its_class() -> None:
    policy = measured()
    replay(policy, [(name, trace) for name in (FREE, GRAMMAR) for trace in TRACES[name][:8]], 1)
    assert policy.expected(Asking("new", FREE, Survival(), 5), 1) == 5
    assert policy.expected(Asking("new", GRAMMAR, Survival(), 5), 1) == 0
    assert policy.expected(Asking("new", FREE, Survival(), 3), 1) == 3  # within its cap
    assert policy.expected(Asking("old", GRAMMAR, Survival(), 3, previous=2), 1) == 2  # its own settled k first


def exhaustive(candidates: Sequence[Candidate], batch: int, policy: DraftLengths) -> float:
    """The best rate of any allocation that slows nobody down, by trying them all."""

    def seconds(rows: int, drafting: int, depth: int) -> float:
        return policy.costs.round_seconds(batch, rows, drafting, depth)

    best = 0.0
    for ks in itertools.product(*(range(len(c.survival) + 1) for c in candidates)):
        rate = rate_of({c.key: k for c, k in zip(candidates, ks, strict=True)}, candidates, batch, seconds)
        best = max(best, rate or 0.0)
    return best


@pytest.mark.parametrize("mix", [(FREE, GRAMMAR), (FREE, PENALTIES, GRAMMAR), (FREE, FREE, PENALTIES)])
def test_a_mixed_batch_gets_nearly_the_best_allocation_that_slows_nobody_down(mix: tuple[str, ...]) -> None:
    policy = measured()
    candidates = [Candidate(f"r{i}", tuple(class_survival(name))) for i, name in enumerate(mix)]

    def seconds(rows: int, drafting: int, depth: int) -> float:
        return policy.costs.round_seconds(len(mix), rows, drafting, depth)

    lengths, rate = allocate(candidates, len(mix), seconds)
    assert rate_of(lengths, candidates, len(mix), seconds) == pytest.approx(rate)  # it slows nobody down
    assert rate >= 0.97 * exhaustive(candidates, len(mix), policy)


@pytest.mark.parametrize("batch", [8, 32])
def test_a_large_batch_of_free_requests_drafts_only_where_every_request_gains(batch: int) -> None:
    policy = measured()
    candidates = [Candidate(f"r{i}", tuple(class_survival(FREE))) for i in range(batch)]

    def seconds(rows: int, drafting: int, depth: int) -> float:
        return policy.costs.round_seconds(batch, rows, drafting, depth)

    lengths, rate = allocate(candidates, batch, seconds)
    uniform = [rate_of(dict.fromkeys(lengths, k), candidates, batch, seconds) or 0.0 for k in range(6)]
    assert rate >= max(uniform) * 0.999
    assert rate_of(lengths, candidates, batch, seconds) is not None


def test_in_a_mixed_stream_of_four_no_step_plans_to_slow_a_class_down() -> None:
    """Free code, JSON and penalised requests interleaved, four at a time: no settled choice slows a class present
    down on average, by the policy's own estimates."""
    policy = measured()
    checked = []

    def fair(asking: Sequence[Asking], choice: Choice) -> None:
        if not policy._measured(len(asking)):
            return  # every request drafts its cap: that measures them
        candidates = [
            Candidate(a.key, tuple(policy.survival(a.request_class, a.own)[: a.cap]), group=group(a)) for a in asking
        ]

        def seconds(rows: int, drafting: int, depth: int) -> float:
            return policy.costs.round_seconds(len(asking), rows, drafting, depth)

        checked.append(rate_of(choice.settled, candidates, len(asking), seconds))

    stream = [(name, TRACES[name][i]) for i in range(len(TRACES[FREE])) for name in (FREE, GRAMMAR, PENALTIES)]
    replay(policy, stream, 4, fair)
    assert len(checked) > 50 and None not in checked


def test_a_request_without_drafts_is_not_slowed_by_the_others_unless_exempt() -> None:
    """A request that decodes target-only (it asked for no speculation) shares every step: a free request beside it
    drafts nothing. One on its last token (one longer step at most) does not count."""
    policy = measured(draft_scale=0.3)  # a draft cheap enough to pay beside a second request
    replay(policy, [(FREE, trace) for trace in TRACES[FREE][:4]], 1)
    free = Asking("free", FREE, Survival(), 5)
    beside_one = policy.expected(free, 2)  # what pays for it with one more row that drafts nothing
    assert beside_one > 0
    assert policy.choose(2, [free, Asking("plain", FREE, Survival(), 0)]).settled == {"free": 0, "plain": 0}
    exempt = Asking("last", FREE, Survival(), 0, exempt=True)
    assert policy.choose(2, [free, exempt]).settled == {"free": beside_one, "last": 0}


def test_once_measured_a_class_whose_drafts_do_not_pay_starts_its_requests_paused_but_one_in_explore_every() -> None:
    fresh = measured()
    assert fresh.admits(GRAMMAR, 1)  # nothing measured: every request gets a replica, which measures
    policy = measured()
    replay(policy, [(name, trace) for name in (FREE, GRAMMAR) for trace in TRACES[name][:8]], 1)
    assert all(policy.admits(FREE, 1) for _ in range(EXPLORE_EVERY))
    admitted = [policy.admits(GRAMMAR, 1) for _ in range(2 * EXPLORE_EVERY)]
    assert admitted.count(True) == 2 and admitted[EXPLORE_EVERY - 1]
    fixed = measured()
    fixed.adaptive = False
    assert fixed.admits(GRAMMAR, 1)


def test_a_request_on_a_bad_streak_does_not_hold_back_the_rest_of_its_class() -> None:
    """Eight free requests, one of which has had its drafts rejected lately: the class gains on average, so the
    others still draft; a JSON request in their place (a class of its own that gains nothing) keeps them all at 0."""
    policy = measured(draft_scale=0.3)  # drafting pays at 8 requests
    replay(policy, [(FREE, trace) for trace in TRACES[FREE][:4]], 1)
    unlucky = Survival(REQUEST_DECAY)
    for _ in range(8):
        unlucky.observe(5, 0)
    asking = [Asking(f"r{i}", FREE, Survival(REQUEST_DECAY), 5) for i in range(7)]
    drafting = policy.choose(8, [*asking, Asking("unlucky", FREE, unlucky, 5)]).settled
    assert min(drafting[a.key] for a in asking) > 0 and drafting["unlucky"] < drafting["r0"], drafting
    json_beside = policy.choose(8, [*asking, Asking("json", GRAMMAR, unlucky, 5)]).settled
    assert set(json_beside.values()) == {0}, json_beside
