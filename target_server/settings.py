"""Settings of a target process; the CLI takes its defaults from these (no torch import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class TargetSettings:
    model_dir: Path
    dtype: str = "float32"  # resolved (tandem.devices): the CLI's "auto" is bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"  # rank 0's device, resolved: "cpu" or "cuda:N" (rank r: cuda:N+r, tandem.devices.rank_device)
    max_context: int = 0  # 0: the model's max_position_embeddings
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    tp: int = 1  # tensor-parallel ranks (target_server.ranks)
    threads: int = 0  # intra-op (OpenMP) threads of each rank's model; 0: the cores this process may use, over tp
    # Where the ranks meet ("host:port", rank 0 serves it). None: rank 0 picks a free loopback port and starts
    # ranks 1..tp-1 itself as child processes; given: someone else (the Ray launcher) starts them.
    rendezvous: str | None = None
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: a free one); None: no endpoint
