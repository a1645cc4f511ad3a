"""What `tandem serve --launcher ray` asks the cluster for (launch.ray_cluster): a placement group of one bundle per
target rank on one node, and a share of a CPU per draft replica; and the line that says why a cluster cannot hold it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import ray

# Ray's resource counts place actors; they do not limit them. One bundle per target rank, so a TP group
# lands on one node. A draft replica (one decoder layer) asks for half a CPU; the orchestrator (I/O and
# bookkeeping) asks for none.
DRAFT_CPUS = 0.5


class NoRoom(RuntimeError):
    """The cluster cannot hold what the stack asks for; the message names both."""


def available_cpus() -> int:
    """CPUs this process may run on (the cgroup/affinity limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True)
class Reservation:
    """What the stack asks Ray for: `ranks` bundles of `rank_bundle` on one node, DRAFT_CPUS per draft replica."""

    rank_bundle: Mapping[str, float]
    ranks: int
    drafts: int

    def total(self) -> dict[str, float]:
        total = {name: amount * self.ranks for name, amount in self.rank_bundle.items()}
        if self.drafts:
            total["CPU"] = total.get("CPU", 0.0) + DRAFT_CPUS * self.drafts
        return total

    def __str__(self) -> str:
        asked = [f"target placement group: {plural(self.ranks, 'bundle')} of {resources(self.rank_bundle)} on one node"]
        if self.drafts:
            asked.append(f"{plural(self.drafts, 'draft replica')} x {DRAFT_CPUS:g} CPU")
        return f"{'; '.join(asked)} ({resources(self.total())} in all)"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def resources(amounts: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in amounts.items())


def rank_bundle(ranks: int) -> dict[str, float]:
    """A GPU per target rank when the cluster has one for each, else a CPU.

    The ranks compute on the CPU today, so a GPU bundle only places them; with fewer GPUs than ranks, GPU bundles
    would make a placement group that is never placed.
    """
    return {"GPU": 1.0} if ray.cluster_resources().get("GPU", 0.0) >= ranks else {"CPU": 1.0}


def no_room(reservation: Reservation, free: Mapping[str, float]) -> str:
    """One line: what the stack asked for, and what the cluster has free of each resource it asked for."""
    total = ray.cluster_resources()
    room = ", ".join(f"{free.get(name, 0.0):g} {name} free of {total.get(name, 0.0):g}" for name in reservation.total())
    return f"the Ray cluster has no room for this stack: asked {reservation}; {room}"
