"""Results of `tandem bench-load`: a summary JSON of a few KB (latest.json) and a Markdown report (latest.md).

Only aggregates are written, whatever the number of streams: errors by status code (with one message of each),
latency percentiles, throughput, the peak resident memory of each process and the KV pools at the end.
"""

from __future__ import annotations

import json
import os
import platform
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.load_settings import LoadSettings
from bench.memory import MIB, ProcessMemory

PERCENTILES = (50, 90, 99)
# A 1-minute load average from this up, before the stack started, is other processes using the machine.
BUSY_LOAD_AVERAGE = 0.5


@dataclass(frozen=True)
class StreamResult:
    index: int  # the stream's position in the draw
    prompt_tokens: int
    max_new_tokens: int
    completion_tokens: int  # tokens received
    first_token_seconds: float | None  # from opening the stream to its first token; None: no token came
    latency_seconds: float  # from opening the stream to its end
    error_code: str | None  # a gRPC status name, or INCOMPLETE (ended short of its budget); None: it succeeded
    error_message: str


@dataclass(frozen=True)
class KVState:
    service: str  # "target" or a draft replica id
    total: int
    free: int
    running_requests: int

    @property
    def back(self) -> bool:
        """Every block of the pool is free again."""
        return self.free == self.total


@dataclass(frozen=True)
class LoadRun:
    streams: Sequence[StreamResult]
    wall_seconds: float  # from opening the streams to the end of the last one
    memory: Sequence[ProcessMemory]
    kv: Sequence[KVState]
    preemptions: int  # requests the orchestrator preempted (its "KV pool full" log lines)

    @property
    def errors(self) -> dict[str, int]:
        return dict(Counter(result.error_code for result in self.streams if result.error_code is not None))

    @property
    def kv_back(self) -> bool:
        return all(state.back for state in self.kv)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, interpolating linearly between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _distribution(values: Sequence[float]) -> dict[str, float | None]:
    found: dict[str, float | None] = {f"p{q}": None for q in PERCENTILES}
    found["max"] = None
    if values:
        found = {f"p{q}": round(percentile(values, q), 4) for q in PERCENTILES}
        found["max"] = round(max(values), 4)
    return found


def _mib(size: int | None) -> float | None:
    return None if size is None else round(size / MIB, 1)


def summary(settings: LoadSettings, run: LoadRun, load_before: float, serve_exit_code: int) -> dict[str, Any]:
    """The summary document (latest.json)."""
    succeeded = [result for result in run.streams if result.error_code is None]
    demand = sum(settings.blocks(result.prompt_tokens + result.max_new_tokens) for result in run.streams)
    completion_tokens = sum(result.completion_tokens for result in run.streams)
    examples: dict[str, str] = {}
    for result in run.streams:
        if result.error_code is not None:
            examples.setdefault(result.error_code, result.error_message[:300])
    recorded = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}
    return {
        "settings": recorded,
        "machine": {
            "platform": f"{platform.system()} {platform.machine()}",
            "cpus": os.cpu_count(),
            # The 1-minute load average before the stack started: the load other processes put on the machine.
            "load_average_before": round(load_before, 2),
        },
        "streams": len(run.streams),
        "succeeded": len(succeeded),
        "errors": run.errors,
        "error_examples": examples,
        "kv_pool": {
            "blocks": settings.kv_blocks,
            "block_size": settings.block_size,
            "demand_blocks": demand,  # every stream's prompt and budget at once
            "demand_over_pool": round(demand / settings.kv_blocks, 2),
        },
        "preemptions": run.preemptions,
        "prompt_tokens": sum(result.prompt_tokens for result in run.streams),
        "completion_tokens": completion_tokens,
        "wall_seconds": round(run.wall_seconds, 2),
        "tokens_per_second": round(completion_tokens / run.wall_seconds, 2),
        "ttft_seconds": _distribution([r.first_token_seconds for r in succeeded if r.first_token_seconds is not None]),
        "e2e_seconds": _distribution([result.latency_seconds for result in succeeded]),
        "memory": [
            {
                "process": process.name,
                "samples": process.samples,
                "rss_start_mib": _mib(process.rss_start_bytes),
                "rss_peak_mib": _mib(process.rss_peak_bytes),
                "rss_end_mib": _mib(process.rss_end_bytes),
                "vm_hwm_mib": _mib(process.vm_hwm_bytes),
            }
            for process in run.memory
        ],
        "kv_blocks": [asdict(state) for state in run.kv],
        "kv_blocks_back": run.kv_back,
        "serve_exit_code": serve_exit_code,
    }


def _cell(value: object) -> str:
    return "–" if value is None else str(value)


def _machine_load(load_average: float) -> str:
    said = f"its 1-minute load average was {load_average} before the stack started"
    if load_average < BUSY_LOAD_AVERAGE:
        return said + "."
    return (
        said + ": the machine was shared and load from other processes was present during the run, so latencies "
        "and throughput are worse than this stack alone would give."
    )


def markdown(document: dict[str, Any]) -> str:
    s = document["settings"]
    pool = document["kv_pool"]
    machine = document["machine"]
    errors = ", ".join(f"{code} {count}" for code, count in sorted(document["errors"].items())) or "none"
    lines = [
        "# tandem bench-load",
        "",
        f"{document['streams']} concurrent greedy Generate streams (opened at once, one channel, ignore_eos) against "
        f"`tandem serve` on loopback; prompts of {s['prompt_tokens'][0]}–{s['prompt_tokens'][1]} tokens of held-out "
        f"code, budgets of {s['new_tokens'][0]}–{s['new_tokens'][1]} new tokens; {s['num_steps']} draft steps.",
        "",
        f"Machine: {machine['platform']}, {machine['cpus']} CPUs; {_machine_load(machine['load_average_before'])}",
        "",
        "| streams | succeeded | errors by code | KV pool (blocks) | demand (blocks) | demand / pool | preemptions "
        "| tokens | wall s | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {document['streams']} | {document['succeeded']} | {errors} | {pool['blocks']} x {pool['block_size']} "
        f"tokens | {pool['demand_blocks']} | {pool['demand_over_pool']}x | {document['preemptions']} "
        f"| {document['completion_tokens']} | {document['wall_seconds']} | {document['tokens_per_second']} |",
        "",
        "| latency (s) | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|",
    ]
    for label, key in (("time to first token", "ttft_seconds"), ("end to end", "e2e_seconds")):
        values = document[key]
        lines.append(f"| {label} | " + " | ".join(_cell(values[k]) for k in ("p50", "p90", "p99", "max")) + " |")
    lines += [
        "",
        "Resident memory (MiB) of each process, sampled every "
        f"{s['sample_interval_s']} s during the load; VmHWM is the kernel's peak since the process started "
        "(model loading included).",
        "",
        "| process | at start | peak | at end | VmHWM |",
        "|---|---|---|---|---|",
    ]
    for process in document["memory"]:
        cells = [process[key] for key in ("rss_start_mib", "rss_peak_mib", "rss_end_mib", "vm_hwm_mib")]
        lines.append(f"| {process['process']} | " + " | ".join(_cell(cell) for cell in cells) + " |")
    lines += ["", "| KV pool at the end | free / total | running requests |", "|---|---|---|"]
    for state in document["kv_blocks"]:
        lines.append(f"| {state['service']} | {state['free']} / {state['total']} | {state['running_requests']} |")
    back = "all blocks back" if document["kv_blocks_back"] else "BLOCKS MISSING"
    lines += ["", f"KV blocks at the end: {back}."]
    for code, message in sorted(document["error_examples"].items()):
        lines.append(f"- {code}: {message}")
    return "\n".join(lines) + "\n"


def write(settings: LoadSettings, run: LoadRun, load_before: float, serve_exit_code: int) -> Path:
    """latest.json and latest.md in the settings' output directory; returns the Markdown's path."""
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    document = summary(settings, run, load_before, serve_exit_code)
    (settings.out_dir / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    (settings.out_dir / "latest.md").write_text(markdown(document))
    return settings.out_dir / "latest.md"
