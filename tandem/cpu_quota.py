"""The CPUs a container's CPU limit lets this process use, and the intra-op threads a service takes by default.

A CPU limit (a Kubernetes pod's `resources.limits.cpu`, `docker run --cpus`) is a CFS quota on the process's cgroup:
so many microseconds of CPU per period, shared by all its threads. PyTorch counts the cores the process may run on,
not the quota, so a service in a 1-CPU pod on a 2-core node ran two OpenMP threads that the kernel throttled in turn:
on the 2-core machine under a 1-CPU quota the demo's target-only decoding went from 93 to 52 tok/s, where one thread
gave 67 (docs/benchmarks.md, "A CPU limit").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def quota_cpus(root: Path = CGROUP_ROOT, membership: str | None = None) -> float | None:
    """CPUs per period the process's cgroup may use, the least along its path up to the hierarchy's root (cgroup
    v2 `cpu.max`, v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`); None without a limit or a readable cgroup.
    `membership`: the text of /proc/self/cgroup (read when None)."""
    if membership is None:
        try:
            membership = MEMBERSHIP.read_text()
        except OSError:
            return None
    limits = [limit for directory in _cpu_directories(root, membership) if (limit := _limit(directory)) is not None]
    return min(limits, default=None)


def applied_limit() -> float | None:
    """The CPU limit a service's default thread count follows: quota_cpus(), but None where OMP_NUM_THREADS is set
    (the user's count is kept as given)."""
    return None if "OMP_NUM_THREADS" in os.environ else quota_cpus()


def default_intra_op_threads(limit: float | None) -> int:
    """PyTorch's default (a thread per core this process may run on, or OMP_NUM_THREADS), no more than `limit`'s
    whole CPUs (applied_limit()), and at least 1."""
    threads = torch.get_num_threads()
    return threads if limit is None else max(1, min(threads, int(limit)))


def _cpu_directories(root: Path, membership: str) -> Iterator[Path]:
    """The cgroup directories that may limit the process's CPU: each of its cpu cgroups and their ancestors."""
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy, mounted at the root
            base = root
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            base = root / controllers
            if not base.is_dir():
                base = root / "cpu"
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            yield directory
            if directory == base:
                break
            directory = directory.parent


def _limit(directory: Path) -> float | None:
    try:
        if (directory / "cpu.max").is_file():
            quota, period = (directory / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        if (directory / "cpu.cfs_quota_us").is_file():
            quota_us = int((directory / "cpu.cfs_quota_us").read_text())
            period_us = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota_us < 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None
