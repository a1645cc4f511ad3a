"""Settings of `tandem bench`; the CLI takes its defaults from here (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchSettings:
    target_dir: Path
    draft_dir: Path
    address: str | None = None  # a running stack; None: start one with `tandem serve`
    num_prompts: int = 32
    max_new_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8)
    num_steps: int = 5
    dtype: str = "float32"  # of target and draft, in both setups
    repeats: int = 1  # runs of each configuration, interleaved across setups and modes; the report takes medians
    draft_replicas: int = 1  # of the split stack started by the benchmark
    target_threads: int = 0  # `tandem serve --target-threads` of that stack (0: its default)
    draft_threads: int = 0  # `tandem serve --draft-threads` of that stack (0: its default)
    colocated: bool = True
    out_dir: Path = Path("bench/results")
