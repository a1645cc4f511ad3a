"""Settings of the orchestrator process; the CLI takes its defaults from these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SchedulerSettings:
    num_steps: int = 5  # draft tokens per round
    max_num_seqs: int = 32  # requests running at once (each step carries at most these)
    # Tokens one target step computes: verification rows first, then prompt chunks (chunked prefill).
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024  # requests queued for admission; beyond, Generate answers RESOURCE_EXHAUSTED
    target_timeout_s: float = 300.0  # a target step or release that takes longer fails its requests
    draft_timeout_s: float = 10.0  # a Propose that takes longer costs its round's drafts and demotes the replica
    reprobe_s: float = 1.0  # first wait before a demoted replica is probed again (doubling, up to 30 s)


@dataclass(frozen=True)
class OrchestratorSettings:
    target_address: str
    draft_addresses: Sequence[str]
    tokenizer_dir: Path
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    default_max_new_tokens: int = 128
    scaler_address: str | None = None  # what starts and stops draft replicas (the `tandem serve` launcher)
