"""Which replica drafts for which request: assignment, failover, re-probing and the pause of adaptive k.

A replica that fails, times out or proposes bad tokens is demoted: its requests move to another replica (or go on
target-only) and it is probed again with backoff until it answers, then serves new requests. When the batch at hand
drafts nothing for a while, every request but one leaves its replica (the pause, `pause_speculation`); a new request
whose class's drafts do not pay starts paused (`admit`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from orchestrator.loop.batching import ActiveRequest, Drafting
from orchestrator.loop.draft_length import DraftLengths, request_class
from orchestrator.loop.validation import ValidatedRequest
from orchestrator.peers.backends import BackendError
from orchestrator.peers.prefix_routes import PrefixRoutes
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings
from tandem.background import in_background
from tandem.layers.block_pool import Marks

LOG = logging.getLogger(__name__)
FIRST_REPROBE_S = 1.0  # the first wait before a demoted replica is probed again (or --reprobe-max-interval)


class Placement:
    def __init__(
        self,
        replicas: ReplicaPool,
        settings: SchedulerSettings,
        speculation: DraftLengths,
        requests: Callable[[], Iterable[ActiveRequest]],  # every request not yet released: running, then waiting
        wake: Callable[[], None],  # runs the scheduler loop now
        # Frees requests on a replica (Releases.release_on): what fails is owed there and sent again until it lands.
        forget: Callable[[str, Sequence[str]], Awaitable[None]],
        block_size: int = 16,  # the target's: requests are routed by the names of its blocks
    ) -> None:
        self.replicas = replicas
        self.routes = PrefixRoutes(block_size)
        self.forget = forget
        self.settings = settings
        self.speculation = speculation
        self.requests = requests
        self.wake = wake
        self.replica_failures = 0  # demotions since start (metrics)
        self.requests_moved = 0  # requests moved off a demoted replica since start (metrics)
        self.requests_paused = 0  # requests taken off (or started without) a replica by adaptive k (metrics)
        self._probes: dict[str, asyncio.Task[None]] = {}

    def assign(self, tokens: Sequence[int] = (), salt: str = "", marks: Marks = ()) -> str | None:
        """A replica for a new or moving request with these tokens (its salt and images' marks), counted against it,
        where its prefix is if that replica is not overloaded (orchestrator.peers.prefix_routes); None when none
        serves."""
        names = self.routes.names(tokens, salt, marks)
        replica = self.replicas.pick(lambda replica_id: self.routes.matched(replica_id, names))
        if replica is not None:
            self.replicas.acquire(replica)
            self.routes.record(replica, names)
        return replica

    def finished(self, request: ActiveRequest) -> None:
        """A finished request stops counting against its replica, which now holds the draft context of its tokens."""
        if request.replica is not None:
            self.replicas.release(request.replica)
            self.routes.record(
                request.replica, self.routes.names(request.tokens, request.params.cache_salt, request.params.marks)
            )

    def replica_failed(self, replica_id: str, reason: str) -> None:
        """Demotes a failed replica and moves its requests to another one (or to target-only); it is probed again
        with backoff and serves new requests once it answers."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.demoted:
            return
        self.replicas.demote(replica_id)
        self.routes.forget(replica_id)  # it may come back as a new instance, holding nothing
        self.replica_failures += 1
        moved = [request for request in self.requests() if request.replica == replica_id]
        self.requests_moved += len(moved)
        LOG.warning("draft replica %s demoted (%s): moving its %d requests", replica_id, reason, len(moved))
        for request in moved:
            self.replicas.release(replica_id)
            request.start_over(self.assign(request.tokens, request.params.cache_salt, request.params.marks))
        # What the replica still holds of them is of no use now; a live but slow replica frees it.
        in_background(self.forget(replica_id, [request.request_id for request in moved]))
        if replica_id not in self._probes:
            self._probes[replica_id] = asyncio.get_running_loop().create_task(self._reprobe(replica_id))

    async def _reprobe(self, replica_id: str) -> None:
        longest = self.settings.reprobe_max_s
        wait = min(FIRST_REPROBE_S, longest)
        try:
            while (replica := self.replicas.get(replica_id)) is not None and replica.demoted:
                await asyncio.sleep(wait)
                try:
                    await replica.backend.probe()
                except BackendError as error:
                    wait = min(2 * wait, longest)
                    LOG.info("draft replica %s still failing (%s); next probe in %.1f s", replica_id, error, wait)
                    continue
                LOG.info("draft replica %s answers again: it serves new requests", replica_id)
                self.replicas.restore(replica_id)
                self.wake()
        finally:
            self._probes.pop(replica_id, None)

    def admit(self, params: ValidatedRequest, batch: int) -> tuple[str | None, bool]:
        """A new request's replica, and whether it starts paused: none when it asks for no speculation; paused when
        drafting does not pay for its class at this batch size (DraftLengths.admits)."""
        if params.disable_speculation:
            return None, False
        if not self.speculation.admits(request_class(params.sampling), batch):
            self.requests_paused += 1
            return None, True
        return self.assign(params.input_ids, params.cache_salt, params.marks), False

    def pause_speculation(self) -> int:
        """At the step the batch at hand becomes paused (it drafted nothing for PAUSE_AFTER steps), takes every
        request but one off its replica: a request at k = 0 still has its hidden rows captured and streamed to the
        replica each step, so that drafting may resume, and that costs what speculation no longer wins back. A
        paused request decodes target-only (several tokens a step) to its end; it is not brought back, since the
        replica would need every row of its context again. The one left, the probe, keeps k measured at this batch
        size; requests admitted later keep their replicas (DraftLengths.admits decides), so that the batch drafts
        again once enough of them would gain and the paused ones, which no drafts may slow, have ended. Returns the
        batch size it judged."""
        # The batch size is every request that wants speculation, paused ones included: they share the steps.
        wanting = [request for request in self.requests() if request.wants_speculation and not request.finished]
        batch = min(len(wanting), self.settings.max_num_seqs)
        attached = [request for request in wanting if request.replica is not None]
        if len(attached) < 2 or not self.speculation.pauses_now(batch):
            return batch
        forget: dict[str, list[str]] = {}
        for request in attached[1:]:
            replica = request.replica
            assert replica is not None
            self.replicas.release(replica)
            if request.opened:
                forget.setdefault(replica, []).append(request.request_id)
            request.pause()
        self.requests_paused += len(attached) - 1
        LOG.info("adaptive k is 0 at %d requests: %d go on without drafts", len(wanting), len(attached) - 1)
        for replica_id, request_ids in forget.items():
            in_background(self.forget(replica_id, request_ids))
        return batch

    def return_orphans(self, running: Iterable[ActiveRequest]) -> None:
        """Brings target-only requests that want speculation back to a replica once one serves (not paused ones)."""
        if not self.replicas.has_serving():
            return
        for request in running:
            if request.drafting is Drafting.TARGET_ONLY and request.wants_speculation and not request.finished:
                request.start_over(self.assign(request.tokens, request.params.cache_salt, request.params.marks))
