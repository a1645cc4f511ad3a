"""The benchmark's time outside compute: draft compute done ahead falls inside the wire it overlapped."""

from __future__ import annotations

import pytest

from bench.report import outside_compute


def test_compute_drafted_ahead_during_the_hops_is_not_time_outside_compute() -> None:
    per_round = {"draft": 4.53, "verify": 13.08, "wire": 2.61, "scheduling": 0.03, "drafted_ahead": 1.69}
    assert outside_compute(per_round) == pytest.approx(0.95)


def test_without_drafting_ahead_it_is_wire_and_scheduling() -> None:
    assert outside_compute({"draft": 6.5, "verify": 15.0, "wire": 2.24, "scheduling": 0.03}) == pytest.approx(2.27)


def test_it_is_never_negative() -> None:
    assert outside_compute({"wire": 0.5, "scheduling": 0.1, "drafted_ahead": 2.0}) == 0.0
