"""Settings shared by several processes (torch-free, so the CLI can build its parser cheaply)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSettings:
    num_blocks: int = 1024  # blocks preallocated in the pool
    block_size: int = 16  # tokens per block
