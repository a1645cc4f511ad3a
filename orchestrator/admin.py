"""OrchestratorAdmin: add, drain and list draft replicas of a running orchestrator."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from orchestrator.backends import DraftBackend
from orchestrator.replicas import Replica
from orchestrator.scheduler import Scheduler
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc

LOG = logging.getLogger(__name__)
DRAIN_POLL_S = 0.1

Connect = Callable[[str], Awaitable[tuple[str, DraftBackend]]]  # address -> (replica id, backend)


def replica_status(replica: Replica, state: str | None = None) -> orchestrator_pb2.ReplicaStatus:
    return orchestrator_pb2.ReplicaStatus(
        replica_id=replica.replica_id,
        address=replica.address,
        state=state or replica.state,
        outstanding=replica.outstanding,
    )


class AdminService(orchestrator_pb2_grpc.OrchestratorAdminServicer):
    def __init__(self, scheduler: Scheduler, connect: Connect, scaler: orchestrator_pb2_grpc.ScalerStub | None) -> None:
        self.scheduler = scheduler
        self.connect = connect
        self.scaler = scaler

    async def Scale(
        self, request: orchestrator_pb2.ScaleRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListReplicasResponse:
        if request.draft_replicas < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"draft_replicas: {request.draft_replicas} < 0")
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

    async def RemoveReplica(
        self, request: orchestrator_pb2.RemoveReplicaRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ReplicaStatus:
        replica = self.scheduler.replicas.get(request.replica_id)
        if replica is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"replica_id: {request.replica_id!r} is not in the pool")
            raise AssertionError("unreachable")
        replica.draining = True
        LOG.info("draining draft replica %s (%d requests)", replica.replica_id, replica.outstanding)
        while replica.outstanding > 0 and self.scheduler.replicas.get(replica.replica_id) is replica:
            await asyncio.sleep(DRAIN_POLL_S)
        self.scheduler.replicas.remove(replica.replica_id)
        LOG.info("draft replica %s removed", replica.replica_id)
        return replica_status(replica, state="removed")

    async def ListReplicas(
        self, request: orchestrator_pb2.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.ListReplicasResponse:
        return orchestrator_pb2.ListReplicasResponse(
            replicas=[replica_status(replica) for replica in self.scheduler.replicas.all()]
        )
