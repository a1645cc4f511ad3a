"""Settings of a target process; the CLI takes its defaults from these (no torch import here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.settings import KVCacheSettings


@dataclass(frozen=True)
class TargetSettings:
    model_dir: Path
    dtype: str = "float32"
    max_context: int = 0  # 0: the model's max_position_embeddings
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
