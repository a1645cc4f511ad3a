"""The target's gRPC service: rank 0 of the target, around TargetRunner.

Model work runs on one worker thread (one forward at a time, in arrival order) so that the event loop
keeps streaming hidden states to drafts while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from tandem.grpc_util import CallFailed, on_call_end
from tandem.leases import Leases, leased_call, leased_stream
from tandem.model_thread import ModelThread
from tandem.sampling.processing import Shaping
from tandem.wire import target_pb2, target_pb2_grpc
from tandem.wire.codec import DEFAULT_CHUNK_BYTES, ShardOf, iter_weight_chunks, tensor_to_proto
from tandem.wire.drafts import tree_from_proto
from tandem.wire.logprobs import logprobs_to_proto
from tandem.wire.sampling import sampling_from_proto, sampling_to_proto
from target_server.images import add_image_embeddings
from target_server.items import (
    MAX_DRAFT_TOKENS,
    TARGET_ONLY,
    CapturedRows,
    ImageBytes,
    ItemStatus,
    OpenRequest,
    RowStream,
    StepItem,
    StepResult,
    TargetRequest,
)
from target_server.ranks import SHARED_TABLES
from target_server.runner import TargetRunner

LOG = logging.getLogger(__name__)
T = TypeVar("T")

STATUS_OF_ITEM = {
    ItemStatus.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ItemStatus.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass
class Subscriber:
    """A draft replica's hidden-state stream."""

    stream: RowStream
    queue: asyncio.Queue[target_pb2.HiddenBatch | None] = field(default_factory=asyncio.Queue)


class TargetService(target_pb2_grpc.TargetServicer):
    def __init__(
        self, runner: TargetRunner, info: target_pb2.TargetInfo, model_thread: ModelThread, orphan_timeout_s: float
    ) -> None:
        self.runner = runner
        self.info = info
        self.subscribers: dict[str, Subscriber] = {}
        self.replica_of: dict[str, str] = {}  # request id -> replica id, for requests that stream hidden states
        self.model_thread = model_thread  # every runner call goes through it, one at a time
        self.leases = Leases(orphan_timeout_s)  # which orchestrator session opened which request
        self.step_listeners: list[Callable[[float], None]] = []  # called with each step's compute seconds (metrics)

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
        info.kv_block_size = self.runner.cache.block_size
        info.max_draft_tokens = MAX_DRAFT_TOKENS
        return info

    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext) -> target_pb2.StepResponse:
        return await leased_call(self.leases, context, lambda session: self._step(request, session))

    async def StepStream(
        self, requests: AsyncIterator[target_pb2.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.StepResponse]:
        async for response in leased_stream(
            self.leases, context, requests, self._step, lambda error: target_pb2.StepResponse(error=error)
        ):
            yield response

    async def _step(self, request: target_pb2.StepRequest, session: str) -> target_pb2.StepResponse:
        if request.target_instance and request.target_instance != self.info.instance:
            raise CallFailed(
                grpc.StatusCode.ABORTED,
                f"this target is instance {self.info.instance}, not {request.target_instance}: it started since and "
                "holds none of that one's requests",
            )
        items: list[StepItem | None] = []
        refused: dict[int, target_pb2.StepResult] = {}
        for index, message in enumerate(request.items):
            try:
                items.append(self._item(message))
            except ValueError as error:
                items.append(None)
                refused[index] = target_pb2.StepResult(
                    request_id=message.request_id,
                    error=CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(error)).as_proto(),
                )
        # A request is owned from the step that opens it, before the runner makes its state (tandem.leases).
        now = time.monotonic()
        claimed = {
            item.request_id
            for item in items
            if item is not None and item.open is not None and self.leases.claim(session, item.request_id, now)
        }
        started = time.perf_counter()
        try:
            results = await self._run(self.runner.step, [item for item in items if item is not None], request.preempt)
        except Exception as error:  # the forward pass itself failed; the runner has undone the step's reservations
            LOG.exception("step of %d items failed", len(request.items))
            self._unclaim(claimed)
            raise CallFailed(grpc.StatusCode.INTERNAL, f"target step failed: {error!r}") from None
        # A step cut off at the await above (its caller gone) keeps its claims: the runner makes that state anyway.
        self._unclaim(claimed)
        compute_seconds = time.perf_counter() - started
        for listener in self.step_listeners:
            listener(compute_seconds)
        answers = iter(results)
        response = target_pb2.StepResponse(compute_seconds=compute_seconds)
        now = time.monotonic()
        outbox: dict[str, list[target_pb2.HiddenStates]] = {}  # replica id -> this step's rows for it
        for index, (message, item) in enumerate(zip(request.items, items, strict=True)):
            if item is None:
                response.results.append(refused[index])
                continue
            result = next(answers)
            if result.status is ItemStatus.OK and item.open is not None:
                self.leases.own(session, item.request_id, now)
            response.results.append(self._result(message, item, result, outbox))
        for replica, messages in outbox.items():
            messages[-1].step_end = True
            subscriber = self.subscribers[replica]
            for batch in hidden_batches(messages):
                subscriber.queue.put_nowait(batch)
        if outbox:
            # The replicas' streams write their rows before this step's answer is written: a replica starts
            # drafting ahead when its rows arrive, while the answer travels to the orchestrator.
            await asyncio.sleep(0)
        response.kv_blocks_free = self.runner.cache.num_free_blocks
        return response

    def _unclaim(self, claimed: set[str]) -> None:
        """Forgets the claims of a finished step's opens that failed: they left no state to free."""
        self.leases.forget([request_id for request_id in claimed if request_id not in self.runner.requests])

    def _item(self, message: target_pb2.StepItem) -> StepItem:
        """The runner's item for a wire item; raises ValueError naming a field the runner cannot take."""
        open_request = None
        if message.HasField("open"):
            sampling = sampling_from_proto(message.open.sampling)
            opened = message.open
            open_request = OpenRequest(
                list(opened.prompt),
                sampling,
                frozenset(opened.end_token_ids),
                list(opened.generated),
                opened.cache_salt,
                tuple(ImageBytes(image.start, image.data, image.crop) for image in opened.images),
            )
        sets_replica = open_request is not None or message.set_replica
        subscriber = self._subscriber(message.draft_replica) if sets_replica else None
        return StepItem(
            message.request_id,
            message.num_tokens,
            tree_from_proto(message.drafts),
            open_request,
            (subscriber.stream if subscriber is not None else TARGET_ONLY) if sets_replica else None,
            replay=message.replay,
            top_logprobs=message.top_logprobs if message.logprobs else None,
            decode_steps=message.decode_steps,
        )

    def _result(
        self,
        message: target_pb2.StepItem,
        item: StepItem,
        result: StepResult,
        outbox: dict[str, list[target_pb2.HiddenStates]],
    ) -> target_pb2.StepResult:
        """Answers for an item, and adds its rows to its replica's messages in `outbox` (replica id -> messages)."""
        if result.status is not ItemStatus.OK:
            code = STATUS_OF_ITEM[result.status]
            return target_pb2.StepResult(
                request_id=result.request_id, error=CallFailed(code, result.message).as_proto()
            )
        if item.stream is not None:
            self.replica_of.pop(message.request_id, None)
            if item.stream.streams:
                self.replica_of[message.request_id] = message.draft_replica
        replica = self.replica_of.get(message.request_id)
        subscriber = self.subscribers.get(replica) if replica else None
        if replica and subscriber is not None and result.captured is not None:
            chunks = hidden_messages(result.captured, message.round)
            request = self.runner.requests.get(message.request_id)
            starts_over = result.captured.start_position <= 0 or bool(result.captured.prefix)
            if starts_over and request is not None:  # rows that start the request over
                shaping = draft_shaping(request)
                if shaping is not None:
                    chunks[0].shaping.CopyFrom(shaping)
            if result.captured.prefix and request is not None:
                chunks[0].prefix_tokens.extend(result.captured.prefix)
                chunks[0].cache_salt = request.cache_salt
                chunks[0].image_starts.extend(start for start, _ in request.marks)
                chunks[0].image_digests.extend(digest for _, digest in request.marks)
            if subscriber.stream.image_embeddings and request is not None and request.images:
                for chunk in chunks:
                    add_image_embeddings(chunk, request.images)
            if message.draft_ahead > 0 and result.new_tokens:  # the round's rows are complete: it may draft now
                chunks[-1].draft_ahead = message.draft_ahead
            outbox.setdefault(replica, []).extend(chunks)
        return target_pb2.StepResult(
            request_id=result.request_id,
            accepted=result.accepted,
            new_tokens=result.new_tokens,
            streaming=subscriber is not None,
            logprobs=logprobs_to_proto(result.logprobs),
            cached_tokens=result.cached_tokens,
        )

    def _subscriber(self, replica: str) -> Subscriber | None:
        """A subscribed replica's stream; None for none or an unknown (e.g. dead) replica: target-only."""
        subscriber = self.subscribers.get(replica) if replica else None
        if replica and subscriber is None:
            LOG.warning("draft replica %r is not subscribed: its request goes on target-only", replica)
        return subscriber

    async def Release(
        self, request: target_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.ReleaseResponse:
        await self._release(list(request.request_ids))
        return target_pb2.ReleaseResponse()

    async def _release(self, request_ids: list[str]) -> None:
        await self._run(self.runner.release, request_ids)
        self.leases.forget(request_ids)
        for request_id in request_ids:
            # The replica frees its state of the request too, even if the orchestrator cannot tell it (it is gone).
            subscriber = self.subscribers.get(self.replica_of.pop(request_id, ""))
            if subscriber is not None:
                released = target_pb2.HiddenStates(request_id=request_id, released=True)
                subscriber.queue.put_nowait(target_pb2.HiddenBatch(rows=[released]))

    async def sweep_orphans(self, interval_s: float) -> None:
        """Frees, every `interval_s`, the requests of orchestrator sessions that are gone (tandem.leases)."""
        while True:
            await asyncio.sleep(interval_s)
            orphans = self.leases.expired(time.monotonic())
            if orphans:
                LOG.warning("freeing %d requests of an orchestrator that went away", len(orphans))
                await self._release(orphans)

    def _capture_problem(self, capture: tuple[int, ...]) -> str:
        """What is wrong with a subscription's capture indices; "" when nothing is."""
        num_layers = self.runner.model.config.num_layers
        kept = {num_layers + 2 + kept.layer for kept in self.runner.model.kept_kv}
        for index in capture:
            # num_layers + 1 is the final norm's output (see tandem.models.stack.run_layers).
            if not 0 <= index <= num_layers + 1 and index not in kept:
                where = f" or one of {sorted(kept)} (kept keys and values)" if kept else ""
                layers = f"the target has {num_layers} layers"
                return f"capture_indices: {index} is outside 0..{num_layers + 1}{where} ({layers})"
        return ""

    async def SubscribeHidden(
        self, request: target_pb2.SubscribeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.HiddenBatch]:
        capture = tuple(request.capture_indices)
        if request.tokens_only and capture:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"capture_indices: {list(capture)}, a tokens_only draft takes none"
            )
        if not capture and not request.tokens_only:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "capture_indices: empty (and not tokens_only)")
        if request.prefix_shift not in (0, 1):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefix_shift: {request.prefix_shift}, not 0 or 1")
        problem = self._capture_problem(capture)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # The newest subscription of a replica id wins: a replica subscribes again when its stream broke, and on a
        # link that went silent this side may not have seen the old stream end yet.
        replaced = self.subscribers.get(request.replica_id)
        if replaced is not None:
            replaced.queue.put_nowait(None)
        caching = request.prefix_caching and bool(capture)
        stream = RowStream(capture, request.tokens_only, caching, request.prefix_shift, request.image_embeddings)
        subscriber = Subscriber(stream)
        self.subscribers[request.replica_id] = subscriber
        what = "tokens only" if request.tokens_only else f"capture indices {list(capture)}"
        again = " again (its earlier stream ended here)" if replaced is not None else ""
        LOG.info("draft replica %s subscribed%s, %s", request.replica_id, again, what)
        on_call_end(context, lambda: self._unsubscribe(request.replica_id, subscriber))
        while (message := await subscriber.queue.get()) is not None:
            yield message

    def _unsubscribe(self, replica: str, subscriber: Subscriber) -> None:
        """The end of a replica's hidden-state stream, however it ended (the replica may have been killed)."""
        if self.subscribers.get(replica) is subscriber:
            del self.subscribers[replica]
            LOG.info("draft replica %s unsubscribed", replica)

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


# Hidden rows per message at most this many bytes of features: a replay of a long context (or a long prompt's
# chunk) goes out as several messages, which the replica joins, instead of one message of hundreds of MiB.
HIDDEN_CHUNK_BYTES = 4 * 1024 * 1024


def hidden_batches(
    messages: list[target_pb2.HiddenStates], chunk_bytes: int = HIDDEN_CHUNK_BYTES
) -> list[target_pb2.HiddenBatch]:
    """A step's messages for one replica, in order, in as few batches (writes of its stream) as keep each batch's
    features within `chunk_bytes` (a message is never split: hidden_messages bounds each). Example, messages of 3,
    2 and 2 MiB with 4 MiB a batch: [3], [2, 2]."""
    batches: list[target_pb2.HiddenBatch] = []
    size = 0
    for message in messages:
        message_bytes = len(message.features.data)
        if not batches or size + message_bytes > chunk_bytes:
            batches.append(target_pb2.HiddenBatch())
            size = 0
        batches[-1].rows.append(message)
        size += message_bytes
    return batches


def hidden_messages(
    rows: CapturedRows, round_number: int, chunk_bytes: int = HIDDEN_CHUNK_BYTES
) -> list[target_pb2.HiddenStates]:
    """The rows as messages of at most `chunk_bytes` of features each (at least one row each), in order."""
    features = rows.features  # [n, width]
    row_bytes = features.shape[1] * features.element_size()
    count = len(rows.next_tokens)
    per_message = max(1, chunk_bytes // row_bytes if row_bytes else count)  # token-only rows: one message
    return [
        target_pb2.HiddenStates(
            request_id=rows.request_id,
            round=round_number,
            start_position=rows.start_position + start,
            next_tokens=rows.next_tokens[start : start + per_message],
            features=tensor_to_proto(features[start : start + per_message]),
        )
        for start in range(0, max(count, 1), per_message)
    ]


def draft_shaping(request: TargetRequest) -> target_pb2.DraftShaping | None:
    """What the request's draft needs to shape its drafts as the rows are shaped (draft_server.shaping); None when
    the request's options leave rows as they are (the grammar shapes drafts on the target: GrammarState.shaped)."""
    shaping = Shaping.of(request.sampling, request.prompt_length, request.tokens[:1])
    if shaping is None:
        return None
    return target_pb2.DraftShaping(
        sampling=sampling_to_proto(replace(shaping.sampling, grammar="")),
        prompt_length=shaping.prompt_length,
        first_token=shaping.tokens[0],
    )
