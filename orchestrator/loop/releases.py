"""Releases: telling the target and the replicas that requests are done, so that they free what they hold.

The loop never waits for a release's answer: a replica busy drafting ahead answers after its batch, which held every
running request about 5 ms per finished one on 2 cores. A release that fails (a peer that did not answer) is owed
where it failed and sent again with the next release there, or after RELEASE_RETRY_S, so that a peer that was slow
or stopped for a while gets its KV back. Releases owed to a replica that left the pool are dropped with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from orchestrator.loop.batching import ActiveRequest
from orchestrator.peers.backends import BackendError, TargetBackend
from orchestrator.peers.replicas import ReplicaPool
from tandem.background import in_background

LOG = logging.getLogger(__name__)
RELEASE_RETRY_S = 1.0  # how often releases that failed are tried again
TARGET = ""  # the key of the target among the places a release may be owed to; replicas go by their ids


class Releases:
    def __init__(
        self,
        target: TargetBackend,
        replicas: ReplicaPool,
        target_answered: Callable[[str | None], None],  # after each target release: None, or why it failed
    ) -> None:
        self.target = target
        self.replicas = replicas
        self.target_answered = target_answered
        self._owed: dict[str, set[str]] = {}  # by where they are owed (TARGET or a replica id)

    @property
    def owed(self) -> bool:
        return bool(self._owed)

    def release(self, requests: Sequence[ActiveRequest]) -> None:
        """Starts the releases of finished requests on the target (those it holds) and on their replicas."""
        by_replica = self.by_replica(requests)
        opened = [request.request_id for request in requests if request.opened]
        in_background(
            asyncio.gather(
                self.release_on(TARGET, opened),
                *(self.release_on(replica, ids) for replica, ids in by_replica.items()),
            )
        )

    async def release_on_replicas(self, requests: Sequence[ActiveRequest]) -> None:
        by_replica = self.by_replica(requests)
        await asyncio.gather(*(self.release_on(replica, ids) for replica, ids in by_replica.items()))

    def by_replica(self, requests: Sequence[ActiveRequest]) -> dict[str, list[str]]:
        """The ids of `requests` by the replica (still in the pool) that holds them."""
        by_replica: dict[str, list[str]] = {}
        for request in requests:
            if request.replica is not None and self.replicas.get(request.replica) is not None:
                by_replica.setdefault(request.replica, []).append(request.request_id)
        return by_replica

    async def release_on(self, where: str, request_ids: Sequence[str], probe: bool = False) -> None:
        """Releases requests on the target (TARGET) or a replica, with what is still owed there; what fails is
        owed again. With `probe`, a release of nothing still goes out: it answers once the peer's model thread
        does."""
        replica = self.replicas.get(where)
        backend = self.target if where == TARGET else replica.backend if replica is not None else None
        owed = [*self._owed.pop(where, ()), *request_ids]
        if backend is None or not (owed or probe):
            return
        try:
            await backend.release(owed)
        except BackendError as error:
            LOG.warning("release of %d requests failed, will retry: %s", len(owed), error)
            self._owed.setdefault(where, set()).update(owed)  # with what another release failed to send meanwhile
            if where == TARGET:
                self.target_answered(str(error))
            return
        if where == TARGET:
            self.target_answered(None)

    async def settle(self, probe_target: bool) -> None:
        """Retries owed releases; with `probe_target` (after a target failure), probes the target too."""
        places = set(self._owed) | ({TARGET} if probe_target else set())
        await asyncio.gather(*(self.release_on(where, (), probe=where == TARGET) for where in places))
