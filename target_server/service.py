"""The target's gRPC service: rank 0 of the target, around TargetRunner.

Model work runs on one worker thread (one forward at a time, in arrival order) so that the event loop
keeps streaming hidden states to drafts while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from tandem.grpc_util import CallFailed, stream_calls, unary_call
from tandem.layers.kv_cache import OutOfKVBlocks
from tandem.model_thread import ModelThread
from tandem.sampling.params import SamplingParams
from tandem.wire import common_pb2, target_pb2, target_pb2_grpc
from tandem.wire.codec import DEFAULT_CHUNK_BYTES, ShardOf, iter_weight_chunks, tensor_to_proto
from target_server.ranks import SHARED_TABLES
from target_server.runner import CapturedRows, PrefillInput, RequestError, StepResult, TargetRunner

LOG = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Subscriber:
    """A draft replica's hidden-state stream."""

    capture: tuple[int, ...]
    queue: asyncio.Queue[target_pb2.HiddenStates | None] = field(default_factory=asyncio.Queue)


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed or None,
    )


class TargetService(target_pb2_grpc.TargetServicer):
    def __init__(self, runner: TargetRunner, info: target_pb2.TargetInfo, model_thread: ModelThread) -> None:
        self.runner = runner
        self.info = info
        self.subscribers: dict[str, Subscriber] = {}
        self.replica_of: dict[str, str] = {}  # request id -> replica id, for requests that stream hidden states
        self.model_thread = model_thread  # every runner call goes through it, one at a time

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await self.model_thread.run(function, *args)

    async def GetInfo(
        self, request: target_pb2.TargetInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetInfo:
        info = target_pb2.TargetInfo()
        info.CopyFrom(self.info)
        info.running_requests = len(self.runner.requests)
        info.kv_blocks_total = self.runner.cache.num_blocks
        info.kv_blocks_free = self.runner.cache.num_free_blocks
        return info

    async def Prefill(
        self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.PrefillResponse:
        inputs = []
        for item in request.items:
            try:
                sampling = sampling_from_proto(item.sampling)
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: {error}")
            inputs.append(
                PrefillInput(item.request_id, list(item.input_ids), sampling, self._capture(item.draft_replica))
            )
        results: list[StepResult] = await self._guarded(context, self._run(self.runner.prefill, inputs))
        for item, prefill_input in zip(request.items, inputs, strict=True):
            if prefill_input.capture:
                self.replica_of[item.request_id] = item.draft_replica
        self._publish(results, round_number=0)
        return target_pb2.PrefillResponse(
            results=[
                target_pb2.PrefillResult(
                    request_id=result.request_id, next_token=result.new_tokens[0], streaming=bool(prefill_input.capture)
                )
                for result, prefill_input in zip(results, inputs, strict=True)
            ]
        )

    def _capture(self, replica: str) -> tuple[int, ...]:
        """The capture indices of a subscribed replica; () for none or an unknown (e.g. dead) replica."""
        subscriber = self.subscribers.get(replica) if replica else None
        if replica and subscriber is None:
            LOG.warning("draft replica %r is not subscribed: its request goes on target-only", replica)
        return subscriber.capture if subscriber is not None else ()

    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await unary_call(context, self._verify(request))

    async def VerifyStream(
        self, requests: AsyncIterator[target_pb2.VerifyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyResponse]:
        async for response in stream_calls(requests, self._verify, lambda e: target_pb2.VerifyResponse(error=e)):
            yield response

    async def _verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        drafts = [(item.request_id, list(item.draft_tokens)) for item in request.items]
        started = time.perf_counter()
        results: list[StepResult] = await self._checked(self._run(self.runner.verify, drafts))
        compute_seconds = time.perf_counter() - started
        rounds = {item.request_id: item.round for item in request.items}
        for result in results:
            self._publish([result], round_number=rounds[result.request_id])
        return target_pb2.VerifyResponse(
            results=[
                target_pb2.VerifyResult(request_id=r.request_id, accepted=r.accepted, new_tokens=r.new_tokens)
                for r in results
            ],
            compute_seconds=compute_seconds,
        )

    async def Release(
        self, request: target_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ReleaseResponse:
        await self._run(self.runner.release, list(request.request_ids))
        for request_id in request.request_ids:
            self.replica_of.pop(request_id, None)
        return target_pb2.ReleaseResponse()

    async def Reassign(
        self, request: target_pb2.ReassignRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ReassignResponse:
        results = []
        for item in request.items:
            capture = self._capture(item.draft_replica)
            rows = await self._guarded(context, self._run(self.runner.reassign, item.request_id, capture))
            self.replica_of.pop(item.request_id, None)
            if rows is not None:
                self.replica_of[item.request_id] = item.draft_replica
                self.subscribers[item.draft_replica].queue.put_nowait(hidden_message(rows, item.round))
            LOG.info("request %s reassigned to %s", item.request_id, item.draft_replica if capture else "no draft")
            results.append(target_pb2.ReassignResult(request_id=item.request_id, streaming=bool(capture)))
        return target_pb2.ReassignResponse(results=results)

    async def SubscribeHidden(
        self, request: target_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.HiddenStates]:
        num_layers = self.runner.model.config.num_layers
        capture = tuple(request.capture_indices)
        if not capture:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "capture_indices: empty")
        for index in capture:
            # num_layers + 1 is the final norm's output (see tandem.models.stack.run_layers).
            if not 0 <= index <= num_layers + 1:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"capture_indices: {index} is outside 0..{num_layers + 1} (the target has {num_layers} layers)",
                )
        if request.replica_id in self.subscribers:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"replica_id: {request.replica_id!r} is subscribed")
        subscriber = Subscriber(capture)
        self.subscribers[request.replica_id] = subscriber
        LOG.info("draft replica %s subscribed, capture indices %s", request.replica_id, list(capture))
        try:
            while (message := await subscriber.queue.get()) is not None:
                yield message
        finally:
            del self.subscribers[request.replica_id]
            LOG.info("draft replica %s unsubscribed", request.replica_id)

    async def GetWeights(
        self, request: target_pb2.WeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.WeightChunk]:
        for name in request.names:
            if name not in SHARED_TABLES:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"names: {name!r} is not one of {', '.join(SHARED_TABLES)}"
                )
        chunk_bytes = request.chunk_bytes or DEFAULT_CHUNK_BYTES
        vocab_size = self.runner.model.config.vocab_size
        for name in request.names:
            # Gathering the shards runs the model's ranks: it goes through the model thread like any forward.
            shards = await self._run(self.runner.weight_shards, name)
            for rank, shard in enumerate(shards):
                for chunk in iter_weight_chunks(name, shard, chunk_bytes, ShardOf(rank, len(shards), vocab_size)):
                    yield chunk

    async def stop(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.queue.put_nowait(None)
        self.model_thread.shutdown()

    def _publish(self, results: Sequence[StepResult], round_number: int) -> None:
        for result in results:
            replica = self.replica_of.get(result.request_id)
            subscriber = self.subscribers.get(replica) if replica else None
            if subscriber is not None and result.captured is not None:
                subscriber.queue.put_nowait(hidden_message(result.captured, round_number))

    async def _guarded(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        return await unary_call(context, self._checked(work))

    @staticmethod
    async def _checked(work: Awaitable[T]) -> T:
        try:
            return await work
        except RequestError as error:
            raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None
        except OutOfKVBlocks as error:
            raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from None


def hidden_message(rows: CapturedRows, round_number: int) -> target_pb2.HiddenStates:
    return target_pb2.HiddenStates(
        request_id=rows.request_id,
        round=round_number,
        start_position=rows.start_position,
        next_tokens=rows.next_tokens,
        features=tensor_to_proto(rows.features),
    )
