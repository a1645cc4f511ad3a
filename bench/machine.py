"""What a benchmark ran on: the machine, and the threads and OpenMP variables of the process."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch
import transformers


def machine() -> str:
    """Architecture, cores this process may use, CPU model, and the versions that set the kernels."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return (
        f"{platform.machine()}, {cores} CPUs ({cpu_model()}), Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


def runtime() -> dict[str, Any]:
    """This process's torch threads (colocated engine, transformers) and the OpenMP variables it runs under."""
    variables = ("GOMP_SPINCOUNT", "OMP_NUM_THREADS")
    return {"torch_threads": torch.get_num_threads(), **{name: os.environ.get(name) for name in variables}}


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "CPU model unknown"
