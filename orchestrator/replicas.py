"""The draft replicas an orchestrator can use, balanced by least outstanding requests."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tandem.grpc_util import channel_options
from tandem.wire import draft_pb2, draft_pb2_grpc


@dataclass
class Replica:
    replica_id: str
    address: str
    channel: grpc.aio.Channel
    stub: draft_pb2_grpc.DraftStub
    outstanding: int = 0


class ReplicaPool:
    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    async def connect(self, address: str) -> draft_pb2.DraftInfo:
        channel = grpc.aio.insecure_channel(address, options=channel_options())
        stub = draft_pb2_grpc.DraftStub(channel)
        info: draft_pb2.DraftInfo = await stub.GetInfo(draft_pb2.DraftInfoRequest(), wait_for_ready=True, timeout=600)
        self._replicas[info.replica_id] = Replica(info.replica_id, address, channel, stub)
        return info

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

    def stub(self, replica_id: str) -> draft_pb2_grpc.DraftStub:
        return self._replicas[replica_id].stub

    async def close(self) -> None:
        for replica in self._replicas.values():
            await replica.channel.close()
