"""The one thread that runs a service's torch work, and why the event loop's thread gets a single intra-op thread.

A service's event loop (gRPC) and its model run on different threads. PyTorch's CPU kernels parallelise with OpenMP
(libgomp), and libgomp gives every thread that opens a parallel region a pool of worker threads of its own. Once the
pools of a process hold more threads than there are cores, libgomp stops spinning between parallel regions, and
every region then pays a futex wake-up of its workers. A forward pass is hundreds of small regions: on the 2-core
machine, loading the demo target on the event loop's thread and running its forwards on a worker thread made each
forward about twice as slow as the same forward in a one-thread process (docs/architecture.md, "Threads").

So a service starts a ModelThread before it touches torch: the model thread takes the process's intra-op threads,
and the thread that created it (the event loop's) is left one, which never opens a pool. Loading and every forward
pass go through `run` / `call`; small tensor work on the event loop's thread (decoding a message) stays serial.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from tandem.cpu_quota import applied_limit, default_intra_op_threads

LOG = logging.getLogger(__name__)
T = TypeVar("T")


def use_intra_op_threads(count: int) -> None:
    """Sets the calling thread's intra-op (OpenMP) thread count.

    PyTorch gives a thread its count lazily, at its first parallel call, from the last `set_num_threads` of ANY
    thread; asking for the count first settles this thread's, so that a later call on another thread cannot
    change it.
    """
    torch.get_num_threads()
    torch.set_num_threads(count)


class ModelThread:
    """One worker thread for a service's model, holding the process's intra-op threads (see the module docstring).

    Create it on the event loop's thread before any torch work there: that thread is confined to one intra-op thread.
    `threads` is the model thread's intra-op thread count; 0: PyTorch's default (one per core this process may use,
    or OMP_NUM_THREADS), no more than a CPU limit allows (tandem.cpu_quota).
    """

    def __init__(self, name: str, threads: int = 0) -> None:
        if threads < 0:
            raise ValueError(f"threads: {threads} (0 for the default, else at least 1)")
        limit = None if threads else applied_limit()  # the cgroup read once; a count given is kept
        count = threads or default_intra_op_threads(limit)
        LOG.info("%s: %d intra-op threads%s", name, count, "" if limit is None else f" (a CPU limit of {limit:g})")
        self._executor = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=name,
            initializer=use_intra_op_threads,
            initargs=(count,),
        )
        self._executor.submit(lambda: None).result()  # the initializer has run before the creator is confined
        use_intra_op_threads(1)
        self.pending = 0  # calls from the event loop that wait for the model thread or run on it (metrics)

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """Runs function on the model thread and waits (blocking): for start-up, before the event loop serves."""
        return self._executor.submit(function, *args).result()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        return await self.start(function, *args)

    def start(self, function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queues function on the model thread now, before the caller next yields to the event loop, and returns
        its future: work queued by the caller afterwards runs after it."""
        self.pending += 1
        future = asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _: asyncio.Future[Any]) -> None:
        self.pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
