"""The benchmark's time outside compute: a round's wall time less the compute in it, drafted ahead included."""

from __future__ import annotations

import pytest

from bench.harness import RequestResult, RunResult, outside_compute


def test_compute_drafted_ahead_during_the_hops_is_not_time_outside_compute() -> None:
    per_round = {"draft": 4.5, "verify": 13.1, "wire": 2.6, "scheduling": 0.03, "drafted_ahead": 1.7, "round": 20.3}
    assert outside_compute(per_round) == pytest.approx(1.0)


def test_time_between_rounds_counts_though_no_phase_holds_it() -> None:
    # Phases add up to 20 ms of a 23 ms round: the 3 ms the stack spent between rounds were outside compute too.
    per_round = {"draft": 6.0, "verify": 12.0, "wire": 1.9, "scheduling": 0.1, "round": 23.0}
    assert outside_compute(per_round) == pytest.approx(5.0)


def test_it_is_never_negative() -> None:
    assert outside_compute({"draft": 5.0, "verify": 10.0, "wire": 0.5, "scheduling": 0.1, "round": 14.0}) == 0.0


def test_the_round_time_is_the_wall_time_after_the_first_token_over_the_rounds() -> None:
    def request(latency: float, first_token: float, rounds: int) -> RequestResult:
        return RequestResult(0, (), 64, rounds, 0, 0, (), latency, first_token)

    run = RunResult("split", True, 2, 1.0, (request(0.35, 0.05, 15), request(0.40, 0.10, 15)))
    assert run.per_round_milliseconds()["round"] == pytest.approx(1000 * (0.30 + 0.30) / 30)
    assert run.per_round_milliseconds()["request"] == pytest.approx(1000 * (0.35 + 0.40) / 30)


def test_time_outside_compute_per_token_counts_the_tokens_decoded_after_the_first() -> None:
    # Two requests of 64 tokens, 15 rounds each after the first token, 300 ms each: 20 ms a round. Compute took 18 ms
    # a round, so 2 ms of each round were outside it: 60 ms over the 126 tokens decoded after the first.
    requests = tuple(RequestResult(0, (), 64, 15, 0, 0, (), 0.35, 0.05) for _ in range(2))
    counters = {"draft": 0.03 * 6, "verify": 0.03 * 12, "drafted_ahead": 0.0}  # seconds over the run's 30 rounds
    run = RunResult("split", True, 1, 1.0, requests, round_seconds=counters)
    assert run.outside_compute_ms_per_token() == pytest.approx(60.0 / 126)
    # A stack started elsewhere measures no parts: nothing to say.
    assert RunResult("split", True, 1, 1.0, requests).outside_compute_ms_per_token() is None
