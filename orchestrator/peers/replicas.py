"""The draft replicas an orchestrator can use, balanced by least outstanding requests.

A replica is "serving" (gets new requests), "draining" (keeps its requests, gets no new ones, then is removed) or
"demoted" (it failed: the scheduler moved its requests elsewhere and probes it until it answers again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from orchestrator.peers.backends import DraftBackend
from orchestrator.peers.prefix_routes import IMBALANCE

Connect = Callable[[str], Awaitable[tuple[str, DraftBackend]]]  # address -> (replica id, backend)

DRAIN_POLL_S = 0.1  # how often a draining replica's outstanding requests are counted


@dataclass
class Replica:
    replica_id: str
    address: str
    backend: DraftBackend
    # The target streams this replica its requests' hidden rows; False for a drafter that reads only their tokens
    # (orchestrator/loop/ngram.py), whose requests the target runs without capture.
    hidden_rows: bool = True
    outstanding: int = 0
    draining: bool = False
    demoted: bool = False

    @property
    def state(self) -> str:
        return "demoted" if self.demoted else "draining" if self.draining else "serving"

    @property
    def serving(self) -> bool:
        return not self.draining and not self.demoted


class ReplicaPool:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    def add(self, replica_id: str, address: str, backend: DraftBackend, hidden_rows: bool = True) -> Replica:
        replica = Replica(replica_id, address, backend, hidden_rows)
        self._replicas[replica_id] = replica
        return replica

    def remove(self, replica_id: str) -> Replica | None:
        return self._replicas.pop(replica_id, None)

    def get(self, replica_id: str | None) -> Replica | None:
        """The replica of that id; None for an unknown one, or for None (a target-only request's)."""
        return self._replicas.get(replica_id) if replica_id is not None else None

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def has_serving(self) -> bool:
        return any(replica.serving for replica in self._replicas.values())

    def demote(self, replica_id: str) -> None:
        self._replicas[replica_id].demoted = True

    def restore(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.demoted = False

    def pick(self, matched: Callable[[str], int] = lambda _: 0) -> str | None:
        """The serving replica with the fewest outstanding requests, or one that holds more of the request's prefix
        (`matched`: its leading blocks a replica holds, orchestrator.peers.prefix_routes) with at most IMBALANCE more;
        None when none serves."""
        serving = [replica for replica in self._replicas.values() if replica.serving]
        if not serving:
            return None
        least = min(serving, key=lambda replica: replica.outstanding)
        best = max(serving, key=lambda replica: (matched(replica.replica_id), -replica.outstanding))
        if matched(best.replica_id) > 0 and best.outstanding <= least.outstanding + IMBALANCE:
            return best.replica_id
        return least.replica_id

    def acquire(self, replica_id: str) -> None:
        self._replicas[replica_id].outstanding += 1

    def release(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.outstanding -= 1

    def backend(self, replica_id: str) -> DraftBackend:
        return self._replicas[replica_id].backend

    async def drain(self, replica: Replica) -> bool:
        """Stops assigning to `replica`, waits until its requests finish, then removes it from the pool.

        Returns False when the replica left the pool some other way while it drained (then nothing is removed).
        Cancelling the wait leaves the replica in the pool, still draining: set `draining` back to serve again.
        """
        replica.draining = True
        while replica.outstanding > 0 and self._replicas.get(replica.replica_id) is replica:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._replicas.get(replica.replica_id) is not replica:
            return False
        del self._replicas[replica.replica_id]
        return True
