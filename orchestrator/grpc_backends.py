"""TargetBackend and DraftBackend over gRPC: the services of `tandem serve` in other processes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

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
from tandem.grpc_util import STATUS_CODES
from tandem.wire import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

_KINDS = {
    grpc.StatusCode.INVALID_ARGUMENT: FailureKind.INVALID,
    grpc.StatusCode.FAILED_PRECONDITION: FailureKind.INVALID,
    grpc.StatusCode.RESOURCE_EXHAUSTED: FailureKind.EXHAUSTED,
}


def _failure(what: str, code: grpc.StatusCode, message: str) -> BackendError:
    """A failed call as the scheduler sees it: "<what>: <STATUS>: <message>", of the kind its status means."""
    return BackendError(_KINDS.get(code, FailureKind.UNAVAILABLE), f"{what}: {code.name}: {message}")


def _backend_error(error: grpc.aio.AioRpcError, what: str) -> BackendError:
    return _failure(what, error.code(), str(error.details()))


class StreamedResponse(Protocol):
    error: common_pb2.CallError

    def HasField(self, field_name: Any) -> bool: ...


Response = TypeVar("Response", bound=StreamedResponse)


class CallStream(Generic[Response]):
    """Calls made one at a time over one long-lived bidirectional stream: write a request, read its response.

    A round trip on an open stream costs a fraction of a unary call's (../shared/REFERENCE.md: about 0.23 against
    0.77 ms). A call that fails on the server comes back as a response with `error` set and leaves the stream open;
    a broken stream is dropped and the next call opens a new one. Failures raise BackendError worded as the unary
    calls' are: "<what>: <STATUS>: <message>".
    """

    def __init__(self, open_stream: Callable[[], Any], what: str) -> None:
        self._open_stream = open_stream
        self.what = what
        self._stream: Any = None  # a grpc.aio.StreamStreamCall, opened at the first call
        self._lock = asyncio.Lock()

    async def call(self, request: object) -> Response:
        async with self._lock:
            if self._stream is None:
                self._stream = self._open_stream()
            stream = self._stream
            try:
                await stream.write(request)
                response = await stream.read()
            except grpc.aio.AioRpcError as error:
                self._stream = None
                raise _backend_error(error, self.what) from None
            except Exception as error:  # e.g. writing to a stream the peer has ended
                self._drop(stream)
                raise BackendError(FailureKind.UNAVAILABLE, f"{self.what}: {error!r}") from None
            except BaseException:
                # Cancelled between write and read: the late response would answer the next call.
                self._drop(stream)
                raise
        if response is grpc.aio.EOF:
            self._drop(stream)
            raise BackendError(FailureKind.UNAVAILABLE, f"{self.what}: the stream ended")
        if response.HasField("error"):
            code = STATUS_CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)
            raise _failure(self.what, code, response.error.message)
        return response

    def _drop(self, stream: Any) -> None:
        stream.cancel()
        if self._stream is stream:
            self._stream = None


class GrpcTarget:
    def __init__(self, stub: target_pb2_grpc.TargetStub) -> None:
        self.stub = stub
        self._verify: CallStream[target_pb2.VerifyResponse] = CallStream(stub.VerifyStream, "target verify")

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
        response = await self._verify.call(target_pb2.VerifyRequest(items=items))
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
        self._propose: CallStream[draft_pb2.ProposeResponse] = CallStream(stub.ProposeStream, "draft propose")

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        items = [draft_pb2.ProposeItem(request_id=t.request_id, round=t.round, num_steps=t.num_steps) for t in tasks]
        response = await self._propose.call(draft_pb2.ProposeRequest(items=items))
        drafts = {result.request_id: list(result.draft_tokens) for result in response.results}
        return ProposedBatch(drafts, response.compute_seconds)

    async def release(self, request_ids: Sequence[str]) -> None:
        try:
            await self.stub.Release(draft_pb2.DraftReleaseRequest(request_ids=request_ids))
        except grpc.aio.AioRpcError as error:
            raise _backend_error(error, "draft release") from None
