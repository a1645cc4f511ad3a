"""Benchmark runs built by hand, as `tandem bench` records them, for tests of its report (no stack, no matplotlib)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.harness import RequestResult, RunResult
from bench.settings import BenchSettings

ACCEPTED_PER_POSITION = (8, 6, 3)  # of 10 rounds: the acceptance per position is 0.8, 0.6, 0.3
ROUND_SECONDS = {"draft": 0.1, "verify": 0.2, "wire": 0.01, "scheduling": 0.001}


def _request(speculative: bool) -> RequestResult:
    accepted = ACCEPTED_PER_POSITION if speculative else ()
    return RequestResult(
        prompt_index=0,
        token_ids=tuple(range(27)),
        completion_tokens=27,
        rounds=10 if speculative else 27,
        draft_tokens=30 if speculative else 0,
        accepted_tokens=sum(accepted),
        accepted_per_position=accepted,
        latency_seconds=0.5,
        first_token_seconds=0.05,
    )


def sample_runs() -> list[RunResult]:
    """Split and colocated at concurrency 1, each speculative and target-only, one request each."""
    return [
        RunResult(
            label, speculative, 1, 0.5 if speculative else 1.0, (_request(speculative),), round_seconds=ROUND_SECONDS
        )
        for label in ("split", "colocated")
        for speculative in (True, False)
    ]


def sample_settings() -> dict[str, Any]:
    """BenchSettings as the report receives them (paths as text), for a draft directory named eagle3."""
    settings = BenchSettings(target_dir=Path("models/target"), draft_dir=Path("models/eagle3"), num_steps=3)
    return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}


def write_sample_report(out_dir: Path) -> Path:
    """The report of the sample runs in `out_dir`; returns latest.md."""
    from bench.report import write

    return write(out_dir, sample_runs(), sample_settings())
