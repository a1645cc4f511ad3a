"""Settings shared by several processes (torch-free, so the CLI can build its parser cheaply)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The bundled demo pair (issue 5), installed with the package.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "eagle3"
# The demo heads for the demo target, selectable as `--draft demo:<name>`.
DEMO_DRAFTS = {name: DEMO_DIR / name for name in ("eagle3", "eagle3-mla", "mtp")}


@dataclass(frozen=True)
class KVCacheSettings:
    num_blocks: int = 1024  # blocks preallocated in the pool
    block_size: int = 16  # tokens per block
