"""`python -m bench.trace [BENCH ARGS]`: where a round's milliseconds go between the processes of the split stack.

`tandem bench`'s per-round columns (draft / verify / wire / scheduling) come from what each call reports; they cannot
say which hop, hand-off or queue the "wire" time is. This runs `tandem bench` (by default one request at a time,
without transformers or the colocated engine: `--concurrency 1 --repeats 1 --num-prompts 8 --no-transformers
--no-colocated`, or the arguments given) with bench/trace/sitecustomize.py loaded into every process it starts,
which logs when each step of a round happened, on the clock every process of the host shares. It then follows each
round with pushed drafts along its critical path:

    target forward ends (runner_end) -> the step's service sees it (compute_end) -> the replica's rows are given to
    gRPC (rows_yield) -> read by the replica (rows_arrived) -> drafting starts on its model thread (draft_start) ->
    ends (draft_end) -> the drafts are queued for the target (push) -> the target reads them (push_arrived) -> the
    step stops waiting for them (take_end) -> the next forward starts (runner_start) -> ends

and the orchestrator's side of the same step, off that path while drafts are pushed: the step's answer leaves the
target (step_out) -> reaches the orchestrator (step_answer) -> the next step is sent (step_send) -> reaches the
target (step_in) -> which starts waiting for the pushed drafts (take_start).

Every event of a path follows the one before by cause, so following each to the first later occurrence of the next
stays within the round. (The rows' write completing, rows_written, is logged too but is not on the path: the replica
may read the rows before the target's stream hears that the write is done.) Each hop's mean, median and 90th
percentile go to `--trace-out` (default bench/results/trace) as latest.json and latest.md; the benchmark's own report
goes to a temporary folder unless `--out` is given. Only rounds whose drafts were pushed (drafting ahead: at most
`--draft-ahead` drafting requests) have this path.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOOK_DIR = Path(__file__).resolve().parent  # holds the sitecustomize.py the traced processes load
DEFAULT_BENCH = ["--concurrency", "1", "--repeats", "1", "--num-prompts", "8", "--no-transformers", "--no-colocated"]
CRITICAL_PATH = (
    "target:runner_end",
    "target:compute_end",
    "target:rows_yield",
    "draft:rows_arrived",
    "draft:draft_start",
    "draft:draft_end",
    "draft:push",
    "target:push_arrived",
    "target:take_end",
    "target:runner_start",
    "target:runner_end",
)
ORCHESTRATOR_SIDE = (
    "target:compute_end",
    "target:step_out",
    "orchestrator:step_answer",
    "orchestrator:step_send",
    "target:step_in",
    "target:take_start",
)
COMPUTE_HOPS = {("draft:draft_start", "draft:draft_end"), ("target:runner_start", "target:runner_end")}
OUTLIER = 5.0  # a followed path longer than this many times the median crossed a round without pushed drafts


@dataclass(frozen=True)
class Event:
    at_ns: int
    name: str  # "<process role>:<event>"


def read_events(directory: Path) -> list[Event]:
    """Every process's events, in time order; a process's role is the `tandem` command it ran."""
    events = []
    for path in directory.glob("*.log"):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        role = next((word for word in lines[0].split() if word in ("target", "draft", "orchestrator")), None)
        if role is None:
            continue  # the benchmark itself, or a helper process
        for line in lines[1:]:
            at, name = line.split()
            events.append(Event(int(at), f"{role}:{name}"))
    return sorted(events, key=lambda event: event.at_ns)


def follow(events: Sequence[Event], path: Sequence[str]) -> list[list[int]]:
    """Each occurrence of path[0] followed, event by event, by the first later occurrence of the next name; the
    times of each such walk (ns), without those much longer than the median (see OUTLIER)."""
    walks = []
    for index, event in enumerate(events):
        if event.name != path[0]:
            continue
        times, position = [event.at_ns], index
        for name in path[1:]:
            position += 1
            while position < len(events) and events[position].name != name:
                position += 1
            if position == len(events):
                break
            times.append(events[position].at_ns)
        if len(times) == len(path):
            walks.append(times)
    if not walks:
        return []
    typical = statistics.median(walk[-1] - walk[0] for walk in walks)
    return [walk for walk in walks if walk[-1] - walk[0] <= OUTLIER * typical]


def hops(walks: Sequence[Sequence[int]], path: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for index in range(1, len(path)):
        spans = sorted((walk[index] - walk[index - 1]) / 1e6 for walk in walks)
        rows.append(
            {
                "from": path[index - 1],
                "to": path[index],
                "median_ms": round(statistics.median(spans), 3),
                "mean_ms": round(statistics.fmean(spans), 3),
                "p90_ms": round(spans[int(0.9 * (len(spans) - 1))], 3),
                "compute": (path[index - 1], path[index]) in COMPUTE_HOPS,
            }
        )
    return rows


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    rounds = follow(events, CRITICAL_PATH)
    side = follow(events, ORCHESTRATOR_SIDE)
    if not rounds:
        raise SystemExit("bench.trace: no round with pushed drafts was traced (drafting ahead off, or no speculation?)")
    critical = hops(rounds, CRITICAL_PATH)
    totals = [(walk[-1] - walk[0]) / 1e6 for walk in rounds]
    return {
        "rounds": len(rounds),
        "round_ms": round(statistics.fmean(totals), 3),
        "round_median_ms": round(statistics.median(totals), 3),
        "compute_ms": round(sum(row["mean_ms"] for row in critical if row["compute"]), 3),
        "outside_compute_ms": round(sum(row["mean_ms"] for row in critical if not row["compute"]), 3),
        "critical_path": critical,
        "orchestrator_side": hops(side, ORCHESTRATOR_SIDE) if side else [],
    }


def markdown(summary: dict[str, Any], bench_args: Sequence[str]) -> str:
    lines = [
        f"`tandem bench {' '.join(bench_args)}`, traced: {summary['rounds']} rounds with pushed drafts. A round's "
        f"critical path took {summary['round_ms']:.2f} ms on average (median {summary['round_median_ms']:.2f}): "
        f"{summary['compute_ms']:.2f} in the two forwards, {summary['outside_compute_ms']:.2f} in every other hop.",
        "",
        "| critical path: from | to | mean ms | median ms | p90 ms |",
        "|---|---|---|---|---|",
    ]
    for row in summary["critical_path"]:
        marker = " (compute)" if row["compute"] else ""
        lines.append(f"| {row['from']} | {row['to']}{marker} | {_times(row)} |")
    if summary["orchestrator_side"]:
        lines += ["", "| orchestrator's side: from | to | mean ms | median ms | p90 ms |", "|---|---|---|---|---|"]
        for row in summary["orchestrator_side"]:
            lines.append(f"| {row['from']} | {row['to']} | {_times(row)} |")
    return "\n".join(lines) + "\n"


def _times(row: dict[str, Any]) -> str:
    return f"{row['mean_ms']:.3f} | {row['median_ms']:.3f} | {row['p90_ms']:.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if "-h" in arguments or "--help" in arguments:
        print(f"usage: python -m bench.trace [--trace-out DIR] [tandem bench arguments]\n\n{__doc__}")
        return 0
    out = Path("bench/results/trace")
    if "--trace-out" in arguments:
        at = arguments.index("--trace-out")
        out = Path(arguments[at + 1])
        del arguments[at : at + 2]
    given = arguments or list(DEFAULT_BENCH)
    bench_args = list(given)
    with tempfile.TemporaryDirectory(prefix="tandem-trace-") as scratch:
        logs = Path(scratch) / "events"
        logs.mkdir()
        if "--out" not in bench_args:
            bench_args += ["--out", str(Path(scratch) / "bench")]
        python_path = os.pathsep.join(filter(None, [str(HOOK_DIR), os.environ.get("PYTHONPATH")]))
        environment = {**os.environ, "PYTHONPATH": python_path, "TANDEM_TRACE_DIR": str(logs)}
        print(f"bench.trace: tandem bench {' '.join(bench_args)}", file=sys.stderr, flush=True)
        finished = subprocess.run([sys.executable, "-m", "launch.cli", "bench", *bench_args], env=environment)
        if finished.returncode != 0:
            print(f"bench.trace: tandem bench exited with {finished.returncode}", file=sys.stderr)
            return finished.returncode
        summary = summarize(read_events(logs))
    summary["bench_args"] = given
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(summary, indent=1))
    report = markdown(summary, given)
    (out / "latest.md").write_text(report)
    print(report)
    return 0
