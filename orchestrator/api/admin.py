"""OrchestratorAdmin: add, drain and list draft replicas of a running orchestrator."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Protocol

import grpc

from orchestrator.loop.scheduler import Scheduler
from orchestrator.peers.replicas import Connect, Replica
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc

LOG = logging.getLogger(__name__)


def replica_status(replica: Replica, state: str | None = None) -> orchestrator_pb2.ReplicaStatus:
    return orchestrator_pb2.ReplicaStatus(
        replica_id=replica.replica_id,
        address=replica.address,
        state=state or replica.state,
        outstanding=replica.outstanding,
    )


class FoundReplicas(Protocol):
    """Draft discovery (orchestrator.peers.discovery.DraftDiscovery) as AddReplica uses it: its name is an allow
    rule."""

    async def resolves_to(self, address: str) -> bool: ...

    async def join_now(self, address: str) -> Replica | None: ...


def address_allowed(address: str, allowed: Collection[str]) -> bool:
    """Whether `address` ("host:port") matches an entry of `allowed`: the same "host:port", or "host:*"."""
    host, _, port = address.rpartition(":")
    return bool(host and port) and (address in allowed or f"{host}:*" in allowed)


class AdminService(orchestrator_pb2_grpc.OrchestratorAdminServicer):
    def __init__(
        self,
        scheduler: Scheduler,
        connect: Connect,
        scaler: orchestrator_pb2_grpc.ScalerStub | None,
        max_draft_replicas: int,
        allowed_addresses: Collection[str],
        discovery: FoundReplicas | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.connect = connect
        self.scaler = scaler
        self.max_draft_replicas = max_draft_replicas
        self.allowed_addresses = frozenset(allowed_addresses)
        self.discovery = discovery  # --draft-dns: AddReplica may also add an address its name resolves to now

    async def Scale(
        self, request: orchestrator_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListReplicasResponse:
        if request.draft_replicas < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"draft_replicas: {request.draft_replicas} < 0")
        if request.draft_replicas > self.max_draft_replicas:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"draft_replicas: {request.draft_replicas} is above --max-draft-replicas {self.max_draft_replicas}",
            )
        if self.scaler is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no scaler: this orchestrator was not started by `tandem serve`; scale the draft replicas with your "
                "deployment and use AddReplica / RemoveReplica",
            )
            raise AssertionError("unreachable")
        try:
            # The scaler calls AddReplica / RemoveReplica back on this service as replicas come and go.
            await self.scaler.Scale(request)
        except grpc.aio.AioRpcError as error:
            await context.abort(error.code(), f"scaler: {error.details()}")
        return await self.ListReplicas(orchestrator_pb2.ListReplicasRequest(), context)

    async def AddReplica(
        self, request: orchestrator_pb2.AddReplicaRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReplicaStatus:
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address: empty")
        if not address_allowed(request.address, self.allowed_addresses):
            if self.discovery is not None and await self.discovery.resolves_to(request.address):
                return await self._join_found(request.address, self.discovery, context)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"address: {request.address} is not allowed; allow it with --allow-draft-address"
                + (" (or have --draft-dns resolve to it)" if self.discovery is not None else ""),
            )
        try:
            replica_id, backend = await self.connect(request.address)
        except grpc.aio.AioRpcError as error:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"address: no draft replica answers at {request.address}: {error.details()}",
            )
            raise AssertionError("unreachable") from error
        if self.scheduler.replicas.get(replica_id) is not None:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"replica {replica_id!r} is already in the pool")
        replica = self.scheduler.replicas.add(replica_id, request.address, backend)
        LOG.info("draft replica %s at %s added", replica_id, request.address)
        self.scheduler.wake()
        return replica_status(replica)

    async def _join_found(
        self, address: str, discovery: FoundReplicas, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReplicaStatus:
        """An address of the discovery's name: it joins as the discovery's own, drained when it leaves DNS."""
        if any(replica.address == address for replica in self.scheduler.replicas.all()):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"address: {address} is already in the pool")
        replica = await discovery.join_now(address)
        if replica is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"address: {address} did not join: no draft replica answers there, or its id is taken (see the log)",
            )
            raise AssertionError("unreachable")
        return replica_status(replica)

    async def RemoveReplica(
        self, request: orchestrator_pb2.RemoveReplicaRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReplicaStatus:
        replica = self.scheduler.replicas.get(request.replica_id)
        if replica is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"replica_id: {request.replica_id!r} is not in the pool")
            raise AssertionError("unreachable")
        LOG.info("draining draft replica %s (%d requests)", replica.replica_id, replica.outstanding)
        await self.scheduler.replicas.drain(replica)
        LOG.info("draft replica %s removed", replica.replica_id)
        return replica_status(replica, state="removed")

    async def ListReplicas(
        self, request: orchestrator_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListReplicasResponse:
        return orchestrator_pb2.ListReplicasResponse(
            replicas=[replica_status(replica) for replica in self.scheduler.replicas.all()]
        )
