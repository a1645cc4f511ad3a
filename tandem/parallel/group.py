"""The tensor-parallel group of one process: who it is, and the collectives that the parallel layers call.

With world size 1 nothing here touches torch.distributed: every collective returns its input, so a single-process
model runs the same code without initialising a process group.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.cpu_quota import applied_limit, default_intra_op_threads
from tandem.errors import StartupError

LOG = logging.getLogger(__name__)

# How long a rank waits for the others to join the group at start-up.
JOIN_TIMEOUT = timedelta(minutes=10)
# Collective timeout. A rank other than 0 waits in a broadcast for rank 0's next command for as long as the target
# sits idle, so the timeout must outlast any idle period; a rank that dies is noticed by its peers' closed
# connections, not by this timeout.
IDLE_TIMEOUT = timedelta(days=365)


class ParallelismError(StartupError):
    """A tensor-parallel size that the model cannot be split into; the message names both numbers."""


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place among the tensor-parallel ranks of one model.

    `device_group` carries the model's collectives (NCCL for CUDA tensors, gloo for CPU ones); `cpu_group` (always
    gloo) carries rank 0's commands to the other ranks. On CPU both are the default group. Both are None with world
    size 1.
    """

    rank: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, size: int, what: str) -> int:
        """This rank's share of `size` things (heads, rows); refuses a world size that does not divide it.

        `what` names the config field, e.g. split(4, "num_attention_heads") at world size 3 refuses with
        "tp 3 does not divide num_attention_heads 4".
        """
        if size % self.world_size != 0:
            raise ParallelismError(
                f"tp {self.world_size} does not divide {what} {size}: every rank needs an equal share of whole ones"
            )
        return size // self.world_size


SINGLE_PROCESS = ParallelGroup()


def join_group(
    rank: int,
    world_size: int,
    rendezvous: str,
    device: torch.device,
    while_waiting: Callable[[], None] = lambda: None,
) -> ParallelGroup:
    """Joins the ranks meeting at `rendezvous` ("host:port", served by rank 0); blocks until all have joined.

    Rank 0 calls `while_waiting` between polls for the others, so that it can give up as soon as one of them has
    died (the callback raises) instead of waiting out JOIN_TIMEOUT.
    """
    if world_size == 1:
        return SINGLE_PROCESS
    host, _, port = rendezvous.rpartition(":")
    store = dist.TCPStore(
        host, int(port), world_size, is_master=rank == 0, timeout=JOIN_TIMEOUT, wait_for_workers=False
    )
    store.set(f"joined/{rank}", "yes")
    if rank == 0:
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not store.check([f"joined/{other}" for other in range(world_size)]):
            while_waiting()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every one of the {world_size} ranks joined within {JOIN_TIMEOUT}")
            time.sleep(0.05)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    LOG.info("rank %d/%d joined the group at %s (%s)", rank, world_size, rendezvous, backend)
    return ParallelGroup(rank, world_size, device_group, cpu_group)


def share_cpu_threads(group: ParallelGroup, threads: int = 0) -> None:
    """Gives each CPU rank `threads` intra-op threads, or (0) its share of the cores this process may use (no more
    than a CPU limit allows).

    Ranks compute in lockstep: with every rank running as many threads as there are cores, the idle threads of one
    rank spin (OpenMP) on the cores that another rank is computing on; on 2 cores that made a tp-2 step 6 times
    slower than with one thread per rank.
    """
    if threads > 0:
        torch.set_num_threads(threads)
    elif group.world_size > 1:
        torch.set_num_threads(max(1, default_intra_op_threads(applied_limit()) // group.world_size))


def leave_group(group: ParallelGroup) -> None:
    if group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def free_rendezvous(host: str = "127.0.0.1") -> str:
    """A "host:port" with a port that was free a moment ago, for rank 0 to serve the group's store on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


def all_reduce(tensor: torch.Tensor, group: ParallelGroup) -> torch.Tensor:  # [...] -> [...] summed over ranks
    """Sums `tensor` over the ranks, in place; returns it."""
    if group.world_size > 1:
        dist.all_reduce(tensor, group=group.device_group)
    return tensor


def all_gather(tensor: torch.Tensor, group: ParallelGroup, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's `tensor` (equal shapes) along `dim`, in rank order, on every rank.

    Example: [n, s] on each of 2 ranks -> [n, 2 * s], columns [0, s) from rank 0.
    """
    if group.world_size == 1:
        return tensor
    pieces = [torch.empty_like(tensor) for _ in range(group.world_size)]
    dist.all_gather(pieces, tensor.contiguous(), group=group.device_group)
    return torch.cat(pieces, dim=dim)


def gather_to_first(tensor: torch.Tensor, group: ParallelGroup) -> list[torch.Tensor]:
    """Every rank's `tensor` (equal shapes), in rank order, on rank 0; the other ranks get an empty list."""
    if group.world_size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(group.world_size)] if group.is_first else None
    dist.gather(tensor, pieces, dst=0, group=group.device_group)
    return pieces or []


def broadcast_from_first(tensor: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (in place), over the command group; returns it."""
    if group.world_size > 1:
        dist.broadcast(tensor, src=0, group=group.cpu_group)
    return tensor


def barrier(group: ParallelGroup) -> None:
    if group.world_size > 1:
        dist.barrier(group=group.cpu_group)
