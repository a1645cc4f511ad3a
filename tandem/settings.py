"""Settings shared by several processes (torch-free, so the CLI can build its parser cheaply)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# What a service process needs in its environment before torch loads (docs/architecture.md, "Threads"). Services
# on one machine compute in turn, each with its own OpenMP pool; libgomp's default spin before an idle worker sleeps
# (300000 rounds) kept the workers of the process that had just finished spinning on the cores the next one was
# computing on, which made the demo's draft and verify passes about twice as slow as in one process. 10000 rounds
# still bridge the gaps between the kernels of one forward pass.
SERVICE_ENVIRONMENT = {"GOMP_SPINCOUNT": "10000"}


def service_environment() -> dict[str, str]:
    """SERVICE_ENVIRONMENT, with the user's own value wherever the environment already sets a variable."""
    return {name: os.environ.get(name, value) for name, value in SERVICE_ENVIRONMENT.items()}


def apply_service_environment() -> None:
    """Sets each SERVICE_ENVIRONMENT variable the user has not set. It acts only before torch is imported, and is
    inherited by the processes this one starts (services, tensor-parallel ranks, a local Ray cluster)."""
    os.environ.update(service_environment())


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
