"""TargetBackend and DraftBackend over gRPC: the services of `tandem serve` in other processes."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from orchestrator.backends import (
    BackendError,
    FailureKind,
    Prefilled,
    PrefillTask,
    ProposedBatch,
    ProposeTask,
    ReassignTask,
    Verified,
    VerifiedBatch,
    VerifyTask,
)
from tandem.wire import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

_KINDS = {
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.EXHAUSTED,
}


def _backend_error(error: grpc.aio.AioRpcError, what: str) -> BackendError:
    kind = _KINDS.get(error.code(), FailureKind.UNAVAILABLE)
    return BackendError(kind, f"{what}: {error.code().name}: {error.details()}")


class GrpcTarget:
    def __init__(self, stub: target_pb2_grpc.TargetStub) -> None:
        self.stub = stub

    async def prefill(self, tasks: Sequence[PrefillTask]) -> list[Prefilled]:
        items = [
            target_pb2.PrefillItem(
                request_id=task.request_id,
                input_ids=task.input_ids,
                draft_replica=task.replica or "",
                sampling=common_pb2.SamplingParams(
                    temperature=task.sampling.temperature,
                    top_p=task.sampling.top_p,
                    top_k=task.sampling.top_k,
                    seed=task.sampling.seed or 0,
                ),
            )
            for task in tasks
        ]
        try:
            response = await self.stub.Prefill(target_pb2.PrefillRequest(items=items))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "target prefill") from None
        return [Prefilled(result.next_token, result.streaming) for result in response.results]

    async def verify(self, tasks: Sequence[VerifyTask]) -> VerifiedBatch:
        items = [
            target_pb2.VerifyItem(request_id=task.request_id, draft_tokens=task.draft_tokens, round=task.round)
            for task in tasks
        ]
        try:
            response = await self.stub.Verify(target_pb2.VerifyRequest(items=items))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "target verify") from None
        results = [Verified(r.request_id, r.accepted, list(r.new_tokens)) for r in response.results]
        return VerifiedBatch(results, response.compute_seconds)

    async def reassign(self, tasks: Sequence[ReassignTask]) -> list[bool]:
        items = [
            target_pb2.ReassignItem(request_id=task.request_id, draft_replica=task.replica or "", round=task.round)
            for task in tasks
        ]
        try:
            response = await self.stub.Reassign(target_pb2.ReassignRequest(items=items))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "target reassign") from None
        return [result.streaming for result in response.results]

    async def release(self, request_ids: Sequence[str]) -> None:
        try:
            await self.stub.Release(target_pb2.ReleaseRequest(request_ids=request_ids))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "target release") from None


class GrpcDraft:
    def __init__(self, stub: draft_pb2_grpc.DraftStub) -> None:
        self.stub = stub

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        items = [draft_pb2.ProposeItem(request_id=t.request_id, round=t.round, num_steps=t.num_steps) for t in tasks]
        try:
            response = await self.stub.Propose(draft_pb2.ProposeRequest(items=items))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "draft propose") from None
        drafts = {result.request_id: list(result.draft_tokens) for result in response.results}
        return ProposedBatch(drafts, response.compute_seconds)

    async def release(self, request_ids: Sequence[str]) -> None:
        try:
            await self.stub.Release(draft_pb2.DraftReleaseRequest(request_ids=request_ids))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "draft release") from None
