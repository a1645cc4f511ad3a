"""The prefix-caching benchmark's report (bench/prefix_report.py) on hand-made runs: medians, the later requests'
figures, the checks' ratios, and tokens compared across the four modes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.prefix_report import checks, identical, summary, write
from bench.prefix_workloads import MODES, Answer, WorkloadRun


def answers(cached: int, later_seconds: float, accepted: int) -> tuple[Answer, ...]:
    first = Answer(0, 0, 100, 0, (5, 6), 1.0, 2, accepted)
    later = Answer(0, 1, 100, cached, (7, 8), later_seconds, 2, accepted)
    return first, later


def runs(repeats: int = 3) -> list[WorkloadRun]:
    made = []
    for repeat in range(repeats):
        for stack, speculative in MODES:
            cached = 96 if stack == "cache" else 0
            seconds = 0.1 if stack == "cache" else 1.0
            queried = 96.0 if stack == "cache" and speculative else 0.0
            made.append(
                WorkloadRun(stack, speculative, repeat, 2.0 + repeat, answers(cached, seconds, 2), queried, queried)
            )
    return made


def test_summary_and_checks_are_ratios_of_the_modes() -> None:
    rows = summary(runs())
    cached = rows["cache, speculative"]
    assert cached["ttft_later_p50"] == 0.1 and cached["hit_rate"] == 96 / 200
    assert cached["tokens_per_second"] == 4 / 3.0  # the median repeat's wall time
    assert cached["acceptance"] == 1 + 4 / 4 and cached["draft_hit_rate"] == 1.0
    found = {what: value for what, value, _ in checks(rows, "multi-turn")}
    assert found["later TTFT p50, cache / no cache, target-only"] == 0.1 / 1.0
    assert found["cached tokens, speculative / target-only"] == 1.0
    assert found["acceptance of later requests, cache / no cache"] == 1.0


def test_tokens_that_differ_in_one_mode_are_reported(tmp_path: Path) -> None:
    made = runs(1)
    assert identical(made)
    changed = replace(made[2], answers=(made[2].answers[0], replace(made[2].answers[1], token_ids=(9,))))
    assert not identical([*made[:2], changed, *made[3:]])
    settings = {"prefix": {"workload": "shared-prefix"}, "repeats": 1}
    report = write(tmp_path, [*made[:2], changed, *made[3:]], settings, "tandem bench --workload shared-prefix")
    assert "identical in all four modes of every repeat: NO" in report.read_text()
