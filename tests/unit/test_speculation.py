"""The adaptive choice of k (orchestrator.loop.speculation's costs, orchestrator.loop.draft_length's choice) on
measurements shaped like the demo pair's on 2 CPU cores, for batches of free-text requests alike; mixed batches and
recorded traces are in test_draft_length.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from orchestrator.loop.accounting import StepTimes, count_round, observe_target_cost
from orchestrator.loop.draft_length import (
    EXPLORE_EVERY,
    FREE,
    PAUSE_AFTER,
    REQUEST_DECAY,
    Asking,
    DraftLengths,
    Survival,
)
from orchestrator.loop.metrics import SchedulerCollector
from orchestrator.loop.output import Stats
from orchestrator.loop.speculation import MIN_PROPOSES, MIN_STEPS, WINDOW, CostLine, bucket
from orchestrator.peers.backends import StepItem, StepOutcome, StepResult
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams

ACCEPTANCE = (0.8, 0.68, 0.6, 0.53, 0.49)  # per position, each given all earlier ones accepted


def target_seconds(tokens: int) -> float:
    return 0.0046 + 0.00065 * tokens


def draft_step_seconds(batch: int) -> float:
    return 0.0010 + 0.00015 * (batch - 1)


HOP_SECONDS = 0.001  # a Propose call's time outside the replica's compute


def warmed(max_k: int = 5) -> DraftLengths:
    """A policy that has seen rounds at batch 1, 8 and 32 with every position drafted, and varied target steps."""
    policy = DraftLengths(max_k)
    for tokens in (1, 6, 12, 48, 64, 192, 300):
        for _ in range(3):
            policy.costs.observe_target(tokens, target_seconds(tokens))
    for batch in (1, 8, 32):
        compute = draft_step_seconds(batch) * (max_k + 1)
        for _ in range(MIN_PROPOSES):
            policy.costs.observe_propose(batch, max_k, HOP_SECONDS + compute, compute)
    observe_acceptance(policy, max_k)
    return policy


def observe_acceptance(policy: DraftLengths, max_k: int = 5) -> None:
    for round_number in range(400):
        # Accepted counts whose per-position rates are ACCEPTANCE, spread evenly over the rounds: position i is
        # accepted in a round whose draw (a permutation of 0..99) is below 100 * ACCEPTANCE[i].
        draw = (round_number * 37) % 100
        accepted = sum(1 for rate in ACCEPTANCE if draw < rate * 100)
        observe_round(policy, max_k, accepted)


def observe_round(policy: DraftLengths, depth: int, accepted: int) -> None:
    """A round of a free-text request with no rounds of its own yet."""
    policy.observe_round(FREE, Survival(), depth, accepted)


def choose(policy: DraftLengths, batch: int, previous: int | None = None) -> int:
    """The deepest k the policy gives a batch of `batch` new free-text requests (each last settled at `previous`)."""
    asking = [Asking(f"r{index}", FREE, Survival(), policy.max_k, previous) for index in range(batch)]
    return max(policy.choose(batch, asking).lengths.values())


def settled(policy: DraftLengths, batch: int) -> int:
    """The deepest k the batch size settled on (its last choice apart from exploration); max_k before any."""
    return policy.current.get(bucket(batch), policy.max_k)


def rate(policy: DraftLengths, batch: int, k: int) -> float:
    """Tokens per second of a round of `batch` free-text requests drafting k each, by the policy's estimates."""
    tokens = batch * (1 + sum(policy.survival(FREE, Survival())[:k]))
    return tokens / policy.costs.round_seconds(batch, batch * (k + 1), batch if k else 0, k)


def test_bucket_groups_batch_sizes_by_powers_of_two() -> None:
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_cost_line_recovers_a_line_and_falls_back_to_proportional_with_one_size() -> None:
    line = CostLine()
    for x in (1, 2, 4, 8, 16):
        line.add(x, 3.0 + 2.0 * x)
    assert line.predict(10) == pytest.approx(23.0)
    single = CostLine()
    for _ in range(5):
        single.add(4, 2.0)
    assert single.predict(8) == pytest.approx(4.0)


def test_acceptance_rates_are_measured_per_position() -> None:
    policy = warmed()
    assert [policy.overall.rate(i) for i in range(5)] == pytest.approx(ACCEPTANCE, abs=0.05)
    assert policy.survival(FREE, Survival()) == pytest.approx(ACCEPTANCE, abs=0.05)


def test_one_request_speculates_fully_and_a_large_batch_not_at_all() -> None:
    policy = warmed()
    assert choose(policy, 1) == 5
    assert choose(policy, 32) == 0
    # The choice is at least as good as the best k alike for every request, by the model.
    for batch in (1, 8, 32):
        best = max(range(6), key=lambda k, batch=batch: rate(policy, batch, k))
        asking = [Asking(f"r{index}", FREE, Survival(), 5) for index in range(batch)]
        lengths = policy.choose(batch, asking).lengths
        tokens = batch + sum(sum(policy.survival(FREE, Survival())[:k]) for k in lengths.values())
        seconds = policy.costs.round_seconds(
            batch, batch + sum(lengths.values()), sum(1 for k in lengths.values() if k), max(lengths.values())
        )
        assert tokens / seconds >= rate(policy, batch, best) * 0.999


def test_before_measurements_and_when_not_adaptive_the_configured_k_is_used() -> None:
    fresh = DraftLengths(5)
    assert choose(fresh, 32) == 5
    for _ in range(MIN_STEPS):
        fresh.costs.observe_target(32, target_seconds(32))
    observe_acceptance(fresh)
    assert choose(fresh, 32) == 5  # no Propose measured at this batch size yet
    compute = draft_step_seconds(32) * 6
    for _ in range(MIN_PROPOSES - 1):
        fresh.costs.observe_propose(32, 5, compute, compute)
    assert choose(fresh, 32) == 5  # too few yet
    fresh.costs.observe_propose(32, 5, compute, compute)
    assert choose(fresh, 32) == 0
    fixed = warmed()
    fixed.adaptive = False
    assert choose(fixed, 32) == 5


def test_hysteresis_keeps_the_current_k_unless_another_is_clearly_better() -> None:
    policy = warmed()
    rates = {k: rate(policy, 1, k) for k in range(6)}
    best = max(rates, key=lambda k: rates[k])
    close = [k for k in rates if k != best and rates[k] * 1.05 >= rates[best]]
    far = [k for k in rates if rates[k] * 1.05 < rates[best]]
    assert close and far, rates  # the measurements above give both kinds at batch 1
    assert choose(policy, 1, previous=close[0]) == close[0]
    assert choose(policy, 1, previous=far[0]) == best


def test_falling_acceptance_turns_speculation_off_for_one_request_too() -> None:
    policy = warmed()
    assert choose(policy, 1) == 5
    for _ in range(400):
        observe_round(policy, 5, 0)  # the draft stops matching (e.g. a different domain)
    assert choose(policy, 1) == 0


def test_with_k_zero_one_round_in_explore_every_still_drafts() -> None:
    policy = warmed()
    choices = [choose(policy, 32) for _ in range(2 * EXPLORE_EVERY)]
    assert choices.count(5) == 2
    assert choices.count(0) == 2 * EXPLORE_EVERY - 2


def test_the_hop_is_not_charged_per_step() -> None:
    """A Propose's fixed cost outside compute must not make each step look dearer when k is small (which would
    push k down further): the per-step estimate is compute over steps, the hop apart."""
    costs = DraftLengths(5).costs
    for k in (5, 2, 1):
        compute = draft_step_seconds(1) * (k + 1)
        costs.observe_propose(1, k, HOP_SECONDS + compute, compute)
    assert costs.draft[1].per_step == pytest.approx(draft_step_seconds(1))
    assert costs.draft_hop[1].value == pytest.approx(HOP_SECONDS)


def block_policy(one_forward: bool) -> DraftLengths:
    """A policy for a block drafter's 7 drafts whose Proposes for one request took the same 3.5 ms at k = 7, 3 and 1
    (one forward drafts them all), read as such (`one_forward`) or per draft step."""
    policy = DraftLengths(7)
    policy.costs.one_forward = one_forward
    for tokens in (1, 8, 16, 32, 48, 64):
        for _ in range(3):
            policy.costs.observe_target(tokens, target_seconds(tokens))
    for k in (7, 3, 1) * MIN_PROPOSES:
        policy.costs.observe_propose(1, k, HOP_SECONDS + 0.0035, 0.0035)
    for round_number in range(400):
        draw = (round_number * 37) % 100
        # The demo's DFlash drafter at one request (bench/results/block-drafts): position i accepted in this share.
        observe_round(policy, 7, sum(1 for rate in (0.74, 0.59, 0.49, 0.41, 0.35, 0.31, 0.28) if draw < rate * 100))
    return policy


def test_a_block_drafters_propose_costs_the_same_for_every_k() -> None:
    """Read per step, flat Proposes make a short draft look cheap and a long one dear; a block drafter's Proposes are
    predicted at what they took whatever k is, and its requests then ask for more of the block."""
    block, per_step = block_policy(one_forward=True), block_policy(one_forward=False)
    assert block.costs.propose_seconds(1, 1) == pytest.approx(block.costs.propose_seconds(1, 7))
    assert block.costs.propose_seconds(1, 7) == pytest.approx(HOP_SECONDS + 0.0035)
    assert per_step.costs.propose_seconds(1, 7) > 2 * per_step.costs.propose_seconds(1, 1)
    assert choose(block, 1) == 7
    # Per step, a shorter draft: 4 here; the colocated benchmark's block drafter settled at 3 so (2026-11-28).
    assert choose(per_step, 1) == 4


def test_below_max_k_exploration_measures_the_positions_not_drafted_and_k_climbs_back() -> None:
    policy = warmed()
    for _ in range(300):  # a stretch where only the first two positions were ever accepted
        observe_round(policy, 5, 2)
    assert policy.overall.rate(4) == pytest.approx(0.0, abs=0.01)
    chosen = []
    previous = None
    for _ in range(40 * EXPLORE_EVERY):
        choice = policy.choose(1, [Asking("r", FREE, Survival(), 5, previous)])
        k, previous = choice.lengths["r"], choice.settled["r"]
        chosen.append(k)
        observe_round(policy, k, k)  # the draft is good again: every drafted position is accepted
    assert chosen[0] == 2  # at first the stale estimates keep k at 2
    assert settled(policy, 1) == 5 and chosen[-EXPLORE_EVERY:] == [5] * EXPLORE_EVERY


def test_a_batch_size_is_paused_only_once_measurements_settle_it_at_zero() -> None:
    fresh = DraftLengths(5)
    assert not fresh.paused(32)  # unmeasured: the configured k, which measures it
    policy = warmed()
    assert not policy.paused(32)  # measured, but no choice made there yet
    assert choose(policy, 32) == 0
    assert not policy.paused(32)  # settled at 0 once: not yet
    for _ in range(PAUSE_AFTER - 1):
        assert not policy.pauses_now(32)
        assert choose(policy, 32) == 0
    assert policy.paused(32) and policy.paused(17)  # the same bucket
    assert policy.pauses_now(32)  # the requests on replicas leave them at this step; later ones keep theirs
    choose(policy, 32)
    assert policy.paused(32) and not policy.pauses_now(32)
    assert choose(policy, 1) == 5 and not policy.paused(1)
    fixed = warmed()
    fixed.adaptive = False
    for _ in range(PAUSE_AFTER):
        choose(fixed, 32)
    assert not fixed.paused(32)


def test_a_k_that_flaps_through_zero_pauses_nobody() -> None:
    """Estimates a few percent apart made k go 4 -> 0 -> 3 within two steps at 8 requests; pausing is for good, so
    it waits for PAUSE_AFTER choices at 0 in a row."""
    policy = warmed()
    draft, hop = policy.costs.draft[32], policy.costs.draft_hop[32]
    free = policy.classes[FREE]
    measured = (list(free.accepted), draft.per_step, hop.value)
    for _ in range(3):
        for _ in range(PAUSE_AFTER - 1):
            choose(policy, 32)  # one in EXPLORE_EVERY drafts in full, still settled at 0
            assert settled(policy, 32) == 0
        # A spell where every draft is accepted and drafting costs nothing: drafting pays, for one choice.
        free.accepted, draft.per_step, hop.value = list(free.drafted), 0.0, 0.0
        choose(policy, 32)
        assert settled(policy, 32) > 0
        free.accepted, draft.per_step, hop.value = measured
    choose(policy, 32)
    assert settled(policy, 32) == 0 and not policy.paused(32)


def test_the_settled_k_is_the_one_rounds_draft_apart_from_exploration() -> None:
    """What a replica drafts ahead for (Scheduler._draft_ahead): at a batch size settled below max_k, the settled
    k, also in the rounds that explore at max_k."""
    policy = warmed()
    assert settled(policy, 32) == 5  # never chosen at: the configured k
    asking = [Asking(f"r{index}", FREE, Survival(), 5) for index in range(32)]
    choices = [policy.choose(32, asking) for _ in range(EXPLORE_EVERY)]
    assert [max(c.lengths.values()) for c in choices].count(5) == 1  # the last one explored, for one request
    assert sorted(choices[-1].lengths.values()) == [0] * 31 + [5]
    assert choices[-1].settled == dict.fromkeys(choices[-1].settled, 0)
    assert settled(policy, 32) == 0 and settled(policy, 17) == 0  # the same bucket
    assert settled(policy, 1) == 5
    fixed = warmed()
    fixed.adaptive = False
    assert fixed.choose(32, asking).settled == dict.fromkeys(choices[-1].settled, 5)


def test_a_new_requests_ingest_is_paid_per_propose_not_per_draft_step() -> None:
    """A fresh server's first request: its first Propose ingests a 110-row prompt (here 40 ms, against 6 ms for the
    drafts). That does not count as draft steps; it costs its share of the Proposes, and k stays at 5."""
    policy = DraftLengths(5)
    for tokens in (1, 6, 12, 6, 1, 6, 6, 6):
        policy.costs.observe_target(tokens, target_seconds(tokens))
    observe_acceptance(policy)
    step = draft_step_seconds(1)
    policy.costs.observe_propose(1, 5, 0.040 + HOP_SECONDS, 0.040, new_rows=110)
    for _ in range(MIN_PROPOSES):
        policy.costs.observe_propose(1, 5, 6 * step + HOP_SECONDS, 6 * step)
    draft = policy.costs.draft[1]
    assert draft.per_step == pytest.approx(step)
    assert draft.per_row == pytest.approx((0.040 - 6 * step) / 110)
    # One ingest in MIN_PROPOSES + 1 Proposes: about that share of what it took beyond its six steps.
    assert 0.0 < draft.ingest < 0.040 / MIN_PROPOSES
    assert choose(policy, 1) == 5


def test_under_steady_arrivals_every_propose_may_ingest_and_the_costs_still_come_apart() -> None:
    """At a large batch with requests arriving all the time, nearly every Propose carries a new request: the fit
    over steps and rows still finds both costs (2 ms a step, 0.1 ms a row) and decides the batch size."""
    policy = warmed()
    for index in range(2 * MIN_PROPOSES):
        rows = 100 * (1 + index % 3)  # one to three new 100-row prompts
        policy.costs.observe_propose(16, 5, 0.012 + 0.0001 * rows, 0.012 + 0.0001 * rows, new_rows=rows)
    draft = policy.costs.draft[16]
    assert (draft.per_step, draft.per_row) == (pytest.approx(0.002), pytest.approx(0.0001))
    assert draft.ingest == pytest.approx(0.0001 * draft.rows.value)
    assert choose(policy, 16) in range(6)  # decided from the measurements (not the configured k by default)
    assert 16 in policy.current


def test_ingests_at_a_large_batch_still_pause_it() -> None:
    """32 new requests' prompts ingested (400 ms, as measured in a benchmark run), then decoding rounds where
    drafting pays a little (6 rows a request cost 62.5 ms against 22.5 ms for one, as bench.steps measured): the
    ingest, paid only by speculating, keeps the batch size at k = 0; without it, k stays up."""

    def policy_at_32(ingest: bool) -> DraftLengths:
        policy = DraftLengths(5)
        for tokens in (32, 64, 128, 192, 96, 32, 160, 192):
            policy.costs.observe_target(tokens, 0.0145 + 0.00025 * tokens)  # the demo target's steps at 32 requests
        observe_acceptance(policy)
        if ingest:
            policy.costs.observe_propose(32, 5, 0.400, 0.400, new_rows=32 * 110)
        for _ in range(MIN_PROPOSES):
            policy.costs.observe_propose(32, 5, 0.018, 0.018)  # 3 ms a step
        return policy

    without = policy_at_32(ingest=False)
    rates = {k: rate(without, 32, k) for k in (0, 5)}
    assert rates[5] > 1.05 * rates[0], rates  # drafting pays by the per-step cost alone
    assert choose(without, 32) > 0
    paying = policy_at_32(ingest=True)
    assert paying.costs.draft[32].per_step == pytest.approx(0.003)
    assert paying.costs.draft[32].ingest > 0.010
    assert [choose(paying, 32) for _ in range(PAUSE_AFTER)] == [0] * PAUSE_AFTER and paying.paused(32)


def test_a_fresh_servers_slow_first_calls_do_not_set_the_costs() -> None:
    """The calls `scripts/quickstart.sh` made on a fresh server (ms, from its log): a short warm-up request, then the
    long one, whose first verification and first two Proposes were 2-4x slower than the rest (in that run the
    previous model, decayed means with the ingests counted as steps, went to k = 0 for most of the request). k stays
    5, the verification's cost is the median of its size, and WINDOW Proposes later the slow ones are forgotten."""
    policy = DraftLengths(5)
    observe_acceptance(policy)
    for tokens, ms in ((6, 15.5), (6, 10.8), (4, 13.8), (1, 10.0), (1, 8.5), (1, 8.4), (6, 27.4), (6, 12.8)):
        policy.costs.observe_target(tokens, ms / 1000)
    policy.costs.observe_propose(1, 5, 0.0126, 0.0108, new_rows=4)
    policy.costs.observe_propose(1, 5, 0.0072, 0.0071)
    policy.costs.observe_propose(1, 3, 0.0053, 0.0053)
    policy.costs.observe_propose(1, 5, 0.0448, 0.0431, new_rows=31)
    policy.costs.observe_propose(1, 5, 0.0247, 0.0247)
    policy.costs.observe_propose(1, 5, 0.0168, 0.0168)
    for _ in range(MIN_PROPOSES - 4):
        assert choose(policy, 1) == 5  # not yet measured enough
        policy.costs.observe_target(6, 0.0127)
        policy.costs.observe_propose(1, 5, 0.0068, 0.0066)
    assert policy.costs.target.predict(6) < 0.0135  # the median of its 8 steps, not their mean (14.1 ms)
    for _ in range(WINDOW):
        assert choose(policy, 1) == 5
        policy.costs.observe_propose(1, 5, 0.0068, 0.0066)
    assert policy.costs.draft[1].per_step == pytest.approx(0.0011)


def quickstart_target_seconds(tokens: int) -> float:
    """The demo target's steps at one request in the quickstart's log: 8.4 ms for one token, 12.7 ms for six."""
    return 0.0075 + 0.00087 * tokens


def cold_start(policy: DraftLengths, rounds: int) -> list[int]:
    """A fresh server as the quickstart meets it: a target-only warm-up (8 single-token passes), then one request
    whose first calls are slow (one-time kernel selection, allocator growth, first-touch pages: its first five
    verifications 2-3x, its first six Proposes 3-12x the steady cost, the first one ingesting a 30-row prompt) and
    whose first rounds happen to accept little (1, 0, 2, 1, 0, 1, 1, 0 tokens), then the demo pair's steady costs and
    acceptance. Returns the k of every round."""
    for _ in range(8):
        policy.costs.observe_target(1, quickstart_target_seconds(1))
    slow_verifications = [0.040, 0.040, 0.030, 0.030, 0.020]
    slow_proposes = [0.080, 0.060, 0.040, 0.030, 0.025, 0.020]
    unlucky = [1, 0, 2, 1, 0, 1, 1, 0]
    chosen = []
    own, previous = Survival(REQUEST_DECAY), None
    for round_number in range(rounds):
        choice = policy.choose(1, [Asking("r", FREE, own, 5, previous)])
        k, previous = choice.lengths["r"], choice.settled["r"]
        chosen.append(k)
        if k > 0:
            compute = slow_proposes.pop(0) if slow_proposes else draft_step_seconds(1) * (k + 1)
            policy.costs.observe_propose(1, k, compute + HOP_SECONDS, compute, new_rows=30 if round_number == 0 else 0)
        policy.costs.observe_target(
            k + 1, slow_verifications.pop(0) if slow_verifications else quickstart_target_seconds(k + 1)
        )
        draw = (round_number * 37) % 100
        steady = sum(1 for rate in ACCEPTANCE[:k] if draw < rate * 100)
        accepted = min(k, unlucky[round_number] if round_number < len(unlucky) else steady)
        policy.observe_round(FREE, own, k, accepted)
    return chosen


def test_a_cold_start_does_not_settle_a_lone_request_below_full_k() -> None:
    """The sequence that, decided on after eight Proposes with a least-squares draft cost, settled k at 0 for the
    rest of the request (issue 34: one quickstart in three). Decided on a window of Proposes with median costs, the
    lone request drafts at full k from its first round to its last."""
    policy = DraftLengths(5)
    chosen = cold_start(policy, 96)
    assert chosen == [5] * 96
    assert policy.current == {1: 5} and not policy.changes and not policy.paused(1)


def test_a_change_of_k_is_logged_with_what_decided_it(caplog: pytest.LogCaptureFixture) -> None:
    policy = warmed()
    caplog.set_level(logging.DEBUG, logger="orchestrator.loop.draft_length")
    asking = [Asking("r0", FREE, Survival(), 5), Asking("r1", FREE, Survival(), 3, previous=3)]
    asking += [Asking(f"r{index}", FREE, Survival(), 5, previous=0) for index in range(2, 32)]
    assert set(policy.choose(32, asking).lengths.values()) == {0}
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3  # the two requests whose k changed, and the batch size's deepest k
    assert lines[0].startswith("request r0 (free): k - -> 0 of 5; acceptance by position 0.81 0.69 0.59 0.53 0.48;")
    assert lines[1].startswith("request r1 (free): k 3 -> 0 of 3; acceptance by position 0.81 0.69 0.59;")
    # The costs are the ones fed in (target_seconds): 32 rows.
    expected = (
        "adaptive k for batches of 17-32: deepest k 5 -> 0 (requests 32 at k 0); target step 25.40 ms for 32 rows"
    )
    assert lines[2] == expected
    assert policy.current[32] == 0 and policy.changes == {32: 1}
    caplog.clear()
    asking = [Asking(f"r{index}", FREE, Survival(), 5, previous=0) for index in range(32)]
    assert set(policy.choose(32, asking).lengths.values()) == {0}  # no change, no line
    assert not caplog.records


def test_metrics_show_each_measured_batch_sizes_settled_k_and_its_changes() -> None:
    policy = warmed()
    assert (choose(policy, 1), choose(policy, 32)) == (5, 0)
    collector = SchedulerCollector(SimpleNamespace(speculation=policy), SimpleNamespace(model_name="m"))  # type: ignore[arg-type]
    settled, changes, lengths, cuts = collector._adaptive_k("m")
    assert [(s.labels["batch_size"], s.value) for s in settled.samples] == [("1", 5), ("32", 0)]
    assert [(s.labels["batch_size"], s.value) for s in changes.samples] == [("1", 0), ("32", 1)]
    by_length = {(s.labels["request_class"], s.labels["k"]): s.value for s in lengths.samples}
    assert by_length == {("free", "0"): 32, ("free", "5"): 1}
    assert [s.value for s in cuts.samples] == [0]  # no drafter scored its drafts


def test_a_multi_token_decode_is_timed_per_forward_pass_forced_tokens_not_counted() -> None:
    """observe_target_cost feeds the cost line one pass: a decode of 4 passes is a quarter of the step's time, and
    tokens a grammar forced (accepted, verified in one pass beside the first) are no passes."""
    seen: list[tuple[int, float]] = []
    policy = SimpleNamespace(observe_target=lambda rows, seconds: seen.append((rows, seconds)))
    items = [StepItem("a", 1, 1, decode_steps=4), StepItem("b", 1, 1, decode_steps=4)]

    def observe(*results: StepResult) -> tuple[int, float]:
        observe_target_cost(policy, items, StepOutcome(list(results), 1.0), False, 1.0)  # type: ignore[arg-type]
        return seen.pop()

    assert observe(StepResult("a", None, 0, [5, 6, 7, 8]), StepResult("b", None, 0, [5, 6])) == (2, 0.25)
    assert observe(StepResult("a", None, 3, [5, 6, 7, 8]), StepResult("b", None, 0, [5, 6])) == (2, 0.5)
    assert observe(StepResult("a", None, 0, []), StepResult("b", None, 0, [])) == (2, 1.0)  # failed: one pass


def test_the_cost_model_counts_the_drafts_accepted_not_the_forced_tokens() -> None:
    rounds: list[tuple[str, int, int]] = []
    policy = SimpleNamespace(observe_round=lambda kind, own, depth, accepted: rounds.append((kind, depth, accepted)))
    grammar = SimpleNamespace(sampling=SamplingParams(grammar="start: /[a-z]+/"))
    request = SimpleNamespace(output=SimpleNamespace(stats=Stats()), params=grammar, acceptance=Survival())
    item = StepItem("a", 1, 1, drafts=DraftTree.chain([5, 6, 7]))
    times = StepTimes(0.0, 0.0, 0.0)
    for accepted, new_tokens in ((5, [5, 30, 31, 32, 33, 34]), (3, [5, 6, 7, 8])):  # junk cut at 6; all accepted
        result = StepResult("a", None, accepted, new_tokens)
        count_round(policy, request, item, result, None, StepOutcome([result], 0.0), times)  # type: ignore[arg-type]
    assert rounds == [("grammar", 3, 1), ("grammar", 3, 3)]
    assert request.output.stats.accepted_tokens == 8  # what the request reports counts every accepted token


def test_drafts_never_accepted_never_pay_even_when_bigger_steps_measured_cheaper() -> None:
    # On a loaded machine the median of one-row steps (40 ms) can come out above that of four-row steps (10 ms);
    # with acceptance 0 the drafts yield nothing, so k = 0 must still win.
    policy = DraftLengths(3, adaptive=True)
    for _ in range(WINDOW):
        policy.costs.observe_target(1, 0.040)
        policy.costs.observe_target(4, 0.010)
        policy.costs.observe_propose(1, 3, 0.004, 0.004)
    for _ in range(50):
        observe_round(policy, 3, 0)
    assert rate(policy, 1, 0) > rate(policy, 1, 3)
    assert choose(policy, 1) == 0
