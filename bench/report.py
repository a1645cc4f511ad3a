"""Benchmark results as JSON, a Markdown table and a PNG of acceptance per draft position."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import RunResult
from bench.png import bar_chart


def runs_of(runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int) -> list[RunResult]:
    """Every run of one configuration, in the order they ran."""
    return [run for run in runs if (run.label, run.speculative, run.concurrency) == (label, speculative, concurrency)]


def find(runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int) -> RunResult | None:
    """The median run of a configuration by tokens/s (the lower median of an even count: always a real run)."""
    matching = sorted(runs_of(runs, label, speculative, concurrency), key=lambda run: run.tokens_per_second)
    return matching[(len(matching) - 1) // 2] if matching else None


def rates(runs: Sequence[RunResult], label: str, speculative: bool, concurrency: int) -> list[float]:
    """Tokens/s of every run of a configuration, in the order they ran."""
    return [round(run.tokens_per_second, 2) for run in runs_of(runs, label, speculative, concurrency)]


def summary(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One row per (setup, concurrency): speculative vs target-only on the same servers, and split vs colocated."""
    rows = []
    for label in ("split", "colocated"):
        for concurrency in sorted({run.concurrency for run in runs}):
            speculative = find(runs, label, True, concurrency)
            target_only = find(runs, label, False, concurrency)
            if speculative is None:
                continue
            colocated = find(runs, "colocated", True, concurrency)
            rows.append(
                {
                    "setup": label,
                    "concurrency": concurrency,
                    "tokens_per_second": round(speculative.tokens_per_second, 2),
                    "tokens_per_second_runs": rates(runs, label, True, concurrency),
                    "target_only_tokens_per_second_runs": rates(runs, label, False, concurrency),
                    "target_only_tokens_per_second": round(target_only.tokens_per_second, 2) if target_only else None,
                    "speedup": round(speculative.tokens_per_second / target_only.tokens_per_second, 3)
                    if target_only
                    else None,
                    "split_over_colocated": round(speculative.tokens_per_second / colocated.tokens_per_second, 3)
                    if label == "split" and colocated
                    else None,
                    # Greedy speculative output must be the target's own: prompts whose completions are identical.
                    "identical_outputs": _identical(speculative, target_only) if target_only else None,
                    "mean_acceptance_length": round(speculative.mean_acceptance_length, 3),
                    "acceptance_per_position": [round(a, 3) for a in speculative.acceptance_per_position()],
                    "per_round_ms": {k: round(v, 3) for k, v in speculative.per_round_milliseconds().items()},
                }
            )
    return rows


def _identical(speculative: RunResult, target_only: RunResult) -> str:
    mine, theirs = speculative.outputs(), target_only.outputs()
    same = sum(1 for index, tokens in mine.items() if theirs.get(index) == tokens)
    return f"{same}/{len(mine)}"


def markdown(rows: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        f"Greedy, {settings['num_prompts']} held-out prompts, {settings['max_new_tokens']} new tokens each, "
        f"k = {settings['num_steps']} draft steps, {settings['draft_replicas']} draft replica(s), "
        f"{settings.get('dtype', 'float32')}, {_repeats(settings.get('repeats', 1))}; {settings['machine']}.",
        "",
        "| setup | concurrency | tok/s (speculative) | tok/s (target-only) | speedup | split / colocated "
        "| identical to target-only | mean acceptance length | acceptance per position "
        "| per round ms: draft / verify / wire / scheduling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        timing = row["per_round_ms"]
        acceptance = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
        lines.append(
            f"| {row['setup']} | {row['concurrency']} | {row['tokens_per_second']} | "
            f"{row['target_only_tokens_per_second']} | {_x(row['speedup'])} | {_x(row['split_over_colocated'])} | "
            f"{row['identical_outputs'] or '–'} | {row['mean_acceptance_length']} | {acceptance} | "
            f"{timing['draft']:.2f} / {timing['verify']:.2f} / {timing['wire']:.2f} / {timing['scheduling']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _repeats(count: int) -> str:
    return "one run each" if count == 1 else f"median of {count} runs each"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def write(out_dir: Path, runs: Sequence[RunResult], settings: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {**settings, "machine": f"{platform.machine()}, {_cpu_count()} CPUs, Python {platform.python_version()}"}
    rows = summary(runs)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    document = {"settings": settings, "summary": rows, "runs": [_run_json(run) for run in runs]}
    (out_dir / f"bench-{stamp}.json").write_text(json.dumps(document, indent=1) + "\n")
    (out_dir / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    table = markdown(rows, settings)
    (out_dir / "latest.md").write_text(table)
    series = [row["acceptance_per_position"] for row in rows if row["setup"] == "split"]
    bar_chart(out_dir / "acceptance_per_position.png", series)
    return out_dir / "latest.md"


def _run_json(run: RunResult) -> dict[str, Any]:
    return {
        "label": run.label,
        "speculative": run.speculative,
        "concurrency": run.concurrency,
        "wall_seconds": run.wall_seconds,
        "tokens_per_second": run.tokens_per_second,
        "mean_acceptance_length": run.mean_acceptance_length,
        "requests": [asdict(request) for request in run.requests],
    }


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))
