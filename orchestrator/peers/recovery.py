"""A target that stopped answering: the requests wait for one, then start over on it from their committed tokens.

A target step that fails as a whole (the stream reset, the process gone, no answer within --target-timeout, or a new
target at the address that refuses steps meant for the one before it) leaves the orchestrator not knowing what the
target holds: the step may have run there with its answer lost. So every request in flight starts over the way a
preempted one is recomputed, but also reopened: its next item carries its prompt and the tokens it generated
(OpenRequest.generated), which the target takes as committed, so that penalties, min_tokens and the grammar go on
where they were, and the client's stream goes on from the last token it got.

Which target answers decides what is left to clean up, by the identity it announces (TargetInfo.instance), never by a
timer: the same instance still holds the requests (a reset connection, a pause) and is told to free them first; a new
instance holds nothing. With no answer within --target-wait, every request fails with UNAVAILABLE naming the cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from orchestrator.peers.backends import BackendError, TargetBackend
from orchestrator.settings import SchedulerSettings

LOG = logging.getLogger(__name__)
PROBE_EVERY_S = 0.25  # how often a target that does not answer is asked again


class TargetGone(Exception):
    """No target answered within the wait; the message names the wait and the last cause."""


async def reach_target(target: TargetBackend, held: Sequence[str], cause: str, settings: SchedulerSettings) -> None:
    """Returns once a target answers and holds none of `held` (request ids opened on it before the failure): a new
    instance, or the same one after they were released there. Raises TargetGone after --target-wait."""
    wait_s = settings.target_wait_s
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if await target.answer():
                LOG.warning("a new target instance answers: %d requests start over on it", len(held))
                return
            await target.release(held)
            return
        except BackendError as error:
            last = str(error)
        if time.monotonic() + PROBE_EVERY_S > deadline:
            raise TargetGone(f"no target answered within {wait_s:g} s (--target-wait) after {cause} (last: {last})")
        await asyncio.sleep(PROBE_EVERY_S)
