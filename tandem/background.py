"""Work the event loop runs without anyone awaiting it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

_RUNNING: set[asyncio.Future[Any]] = set()


def in_background(work: Awaitable[Any]) -> asyncio.Future[Any]:
    """Runs `work` on the running loop without awaiting it, holding it until it ends: the loop keeps only weak
    references to its tasks, so one nobody holds may be collected before it finishes."""
    future = asyncio.ensure_future(work)
    _RUNNING.add(future)
    future.add_done_callback(_RUNNING.discard)
    return future


async def settled(timeout_s: float) -> None:
    """Waits up to `timeout_s` for the work started with in_background to end (what a shutdown lets finish)."""
    pending = [future for future in _RUNNING if not future.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
