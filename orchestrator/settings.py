"""Settings of the orchestrator process; the CLI takes its defaults from these."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SchedulerSettings:
    num_steps: int = 5  # draft tokens per round
    max_batch_size: int = 32
    max_prefill_tokens: int = 8192  # prompt tokens admitted in one prefill call


@dataclass(frozen=True)
class OrchestratorSettings:
    target_address: str
    draft_addresses: Sequence[str]
    tokenizer_dir: Path
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    default_max_new_tokens: int = 128
    scaler_address: str | None = None  # what starts and stops draft replicas (the `tandem serve` launcher)
