"""Settings of a draft replica process; the CLI takes its defaults from these (no torch import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.models.aux_layers import Convention
from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class DraftSettings:
    model_dir: Path
    target_address: str
    replica_id: str
    num_steps: int = 5
    aux_layer_convention: Convention = "auto"
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    dtype: str = "float32"
    rows_timeout_s: float = 60.0  # how long Propose waits for the target's rows of a round
    rows_ttl_s: float = 120.0  # rows nobody asked for (finished requests) are dropped after this
