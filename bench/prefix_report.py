"""The report of `tandem bench --workload shared-prefix | multi-turn` (bench/prefix_workloads.py): each mode's time
to first token, tokens per second, cache hit rate and acceptance, medians over the repeats, and the checks the
prefix caches are held to, as ratios within the run.

"Later" requests are those that can hit the cache: a prefix's second request on, a conversation's second turn on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from bench.machine import machine
from bench.prefix_workloads import MODES, Answer, WorkloadRun


def _quantile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


def _acceptance(answers: Sequence[Answer]) -> float:
    rounds = sum(answer.rounds for answer in answers)
    return 1 + sum(answer.accepted_tokens for answer in answers) / rounds if rounds else 0.0


def _one(run: WorkloadRun) -> dict[str, float]:
    first = [answer for answer in run.answers if answer.index == 0]
    later = [answer for answer in run.answers if answer.index > 0]
    return {
        "ttft_first_p50": _quantile([a.first_token_seconds for a in first], 0.5),
        "ttft_later_p50": _quantile([a.first_token_seconds for a in later], 0.5),
        "ttft_later_p90": _quantile([a.first_token_seconds for a in later], 0.9),
        "tokens_per_second": sum(len(a.token_ids) for a in run.answers) / run.wall_seconds,
        "hit_rate": sum(a.cached_tokens for a in run.answers) / sum(a.prompt_tokens for a in run.answers),
        "cached_tokens": sum(a.cached_tokens for a in run.answers),
        "acceptance": _acceptance(run.answers),
        "acceptance_later": _acceptance(later),
        "draft_hit_rate": run.draft_cached / run.draft_queried if run.draft_queried else 0.0,
    }


def summary(runs: Sequence[WorkloadRun]) -> dict[str, dict[str, float]]:
    """Each mode's figures, the median of its repeats' (mode names as in the table)."""
    rows = {}
    for stack, speculative in MODES:
        ones = [_one(run) for run in runs if (run.stack, run.speculative) == (stack, speculative)]
        rows[_mode(stack, speculative)] = {key: median(one[key] for one in ones) for key in ones[0]}
    return rows


def _mode(stack: str, speculative: bool) -> str:
    return f"{stack}, {'speculative' if speculative else 'target-only'}"


def identical(runs: Sequence[WorkloadRun]) -> bool:
    """Whether every request got the same tokens in the four modes of each repeat."""
    for repeat in {run.repeat for run in runs}:
        answers = [{(a.group, a.index): a.token_ids for a in run.answers} for run in runs if run.repeat == repeat]
        if any(other != answers[0] for other in answers[1:]):
            return False
    return True


def checks(rows: dict[str, dict[str, float]], workload: str) -> list[tuple[str, float, str]]:
    """(what, measured ratio, the bound it is held to)."""
    ttft_bound = "<= 0.20" if workload == "shared-prefix" else "<= 0.25"
    found = []
    for mode in ("speculative", "target-only"):
        on, off = rows[f"cache, {mode}"], rows[f"no cache, {mode}"]
        found.append(
            (f"later TTFT p50, cache / no cache, {mode}", on["ttft_later_p50"] / off["ttft_later_p50"], ttft_bound)
        )
        found.append(
            (
                f"tokens/s, cache / no cache, {mode}",
                on["tokens_per_second"] / off["tokens_per_second"],
                ">= 2 (multi-turn)",
            )
        )
    spec, alone = rows["cache, speculative"], rows["cache, target-only"]
    found.append(
        ("cached tokens, speculative / target-only", spec["cached_tokens"] / alone["cached_tokens"], ">= 0.95")
    )
    uncached = rows["no cache, speculative"]["acceptance_later"]
    found.append(("acceptance of later requests, cache / no cache", spec["acceptance_later"] / uncached, ">= 0.97"))
    return found


def write(out_dir: Path, runs: Sequence[WorkloadRun], settings: dict[str, Any], command: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, workload = summary(runs), settings["prefix"]["workload"]
    found, same = checks(rows, workload), identical(runs)
    document = {"command": command, "settings": settings, "machine": machine(), "summary": rows, "identical": same}
    (out_dir / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        f"# Prefix caching: {workload}",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine()}. Medians of {settings['repeats']} interleaved repeats.",
        "",
        "| mode | TTFT first p50 (s) | TTFT later p50 (s) | TTFT later p90 (s) | tok/s | hit rate | acceptance | "
        "acceptance, later | draft context found |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in rows.items():
        speculative = mode.endswith("speculative")
        lines.append(
            f"| {mode} | {row['ttft_first_p50']:.3f} | {row['ttft_later_p50']:.3f} | {row['ttft_later_p90']:.3f} "
            f"| {row['tokens_per_second']:.1f} | {row['hit_rate']:.1%} "
            f"| {row['acceptance']:.2f} | {row['acceptance_later']:.2f} "
            f"| {row['draft_hit_rate']:.0%} |"
            if speculative
            else f"| {mode} | {row['ttft_first_p50']:.3f} | {row['ttft_later_p50']:.3f} | {row['ttft_later_p90']:.3f} "
            f"| {row['tokens_per_second']:.1f} | {row['hit_rate']:.1%} | | | |"
        )
    lines += ["", "| check | measured | held to |", "|---|---|---|"]
    lines += [f"| {what} | {value:.3f} | {bound} |" for what, value, bound in found]
    lines += ["", f"Greedy tokens identical in all four modes of every repeat: {'yes' if same else 'NO'}.", ""]
    (out_dir / "latest.md").write_text("\n".join(lines))
    return out_dir / "latest.md"
