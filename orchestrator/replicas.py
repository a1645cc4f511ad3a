"""The draft replicas an orchestrator can use, balanced by least outstanding requests."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.backends import DraftBackend


@dataclass
class Replica:
    replica_id: str
    backend: DraftBackend
    outstanding: int = 0


class ReplicaPool:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    def add(self, replica_id: str, backend: DraftBackend) -> None:
        self._replicas[replica_id] = Replica(replica_id, backend)

    def pick(self) -> str | None:
        """The replica with the fewest outstanding requests, or None when there is none."""
        if not self._replicas:
            return None
        return min(self._replicas.values(), key=lambda replica: replica.outstanding).replica_id

    def acquire(self, replica_id: str) -> None:
        self._replicas[replica_id].outstanding += 1

    def release(self, replica_id: str) -> None:
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.outstanding -= 1

    def backend(self, replica_id: str) -> DraftBackend:
        return self._replicas[replica_id].backend
