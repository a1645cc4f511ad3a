"""A draft replica's gRPC service and its start-up against the target.

Start-up: read the target's info, load the draft (draft_server.formats: check compatibility, resolve the
capture indices), pull the shared tables the checkpoint lacks from the target, subscribe to the target's
hidden-state stream. Per round, Propose joins the orchestrator's request with the target's rows for
the same (request id, round) and runs the runner on one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from draft_server.formats import PreparedDraft, ProposalRunner, prepare_draft, propose_what_fits
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput, TargetRows
from draft_server.settings import DraftSettings
from draft_server.shared_tables import pull_tables
from draft_server.tree_draft import DraftTree, TreeDrafter
from tandem.grpc_util import CallFailed, wait_for_ready
from tandem.leases import Leases, leased_call, leased_stream
from tandem.model_thread import ModelThread
from tandem.models.config import ConfigError
from tandem.wire import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire.codec import tensor_from_proto

LOG = logging.getLogger(__name__)
T = TypeVar("T")


class DraftService(draft_pb2_grpc.DraftServicer):
    def __init__(
        self, runner: ProposalRunner, settings: DraftSettings, prepared: PreparedDraft, model_thread: ModelThread
    ) -> None:
        self.runner = runner
        self.prepared = prepared
        self.settings = settings
        self._rows: dict[tuple[str, int], tuple[TargetRows, float]] = {}
        self._arrived = asyncio.Condition()
        self.model_thread = model_thread  # every runner call goes through it, one at a time
        self.leases = Leases(settings.cache.orphan_timeout_s)  # which orchestrator session drafts which request
        self.propose_listeners: list[Callable[[float], None]] = []  # called with each Propose's compute seconds
        # Called with the seconds each Propose waited for the target's hidden rows of its requests (see _propose).
        self.rows_wait_listeners: list[Callable[[float], None]] = []

    async def consume(self, stream: AsyncIterator[target_pb2.HiddenStates]) -> None:
        """Stores the target's rows as they arrive, keyed by (request id, round)."""
        async for message in stream:
            rows = TargetRows(message.start_position, list(message.next_tokens), tensor_from_proto(message.features))
            key = (message.request_id, message.round)
            async with self._arrived:
                earlier = self._rows.get(key)
                if earlier is not None:
                    # A later chunk of the same round (chunked prefill, or a replay followed by new rows).
                    try:
                        rows = earlier[0].followed_by(rows)
                    except DraftRequestError as error:
                        LOG.warning("request %s round %d: %s; keeping the later rows", *key, error)
                self._rows[key] = (rows, time.monotonic())
                self._arrived.notify_all()

    async def GetInfo(
        self, request: draft_pb2.DraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftInfo:
        return draft_pb2.DraftInfo(
            replica_id=self.settings.replica_id,
            architecture=self.prepared.architecture,
            kind=self.prepared.kind,
            num_steps=self.settings.num_steps,
            capture_indices=list(self.prepared.capture.indices),
            running_requests=len(self.runner.requests),
            kv_blocks_total=self.runner.cache.num_blocks,
            kv_blocks_free=self.runner.cache.num_free_blocks,
        )

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        return await leased_call(self.leases, context, lambda session: self._propose(request, session))

    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeResponse]:
        async for response in leased_stream(
            self.leases, context, requests, self._propose, lambda error: draft_pb2.ProposeResponse(error=error)
        ):
            yield response

    async def _propose(self, request: draft_pb2.ProposeRequest, session: str) -> draft_pb2.ProposeResponse:
        # The hidden-row lag: from the call's arrival until the rows of all its requests reach their rows_end. The
        # target streams a round's rows when its step ends and the orchestrator proposes only after reading that
        # step's answer, so the rows normally arrive first and this stays near 0; when it does not, the
        # target->draft stream is what the round waits for. Calls that fail while waiting are not timed.
        waiting = time.perf_counter()
        inputs = []
        for item in request.items:
            try:
                rows = await self._take_rows(item.request_id, item.round, item.rows_end)
            except DraftRequestError as error:
                raise CallFailed(grpc.StatusCode.FAILED_PRECONDITION, f"request {item.request_id!r}: {error}") from None
            inputs.append(ProposeInput(item.request_id, rows, item.num_steps or self.settings.num_steps))
        started = time.perf_counter()
        for listener in self.rows_wait_listeners:
            listener(started - waiting)
        try:
            drafts, exhausted = await self._run(propose_what_fits, self.runner, inputs)
        except DraftRequestError as error:
            raise CallFailed(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
        response = draft_pb2.ProposeResponse(compute_seconds=time.perf_counter() - started)
        for listener in self.propose_listeners:
            listener(response.compute_seconds)
        now = time.monotonic()
        for item in request.items:
            self.leases.own(session, item.request_id, now)
            if item.request_id in exhausted:
                reason = f"draft {self.settings.replica_id}: {exhausted[item.request_id]}"
                failure = CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, reason).as_proto()
                response.results.append(draft_pb2.ProposeResult(request_id=item.request_id, error=failure))
            else:
                proposal = drafts[item.request_id]
                tree = proposal if isinstance(proposal, DraftTree) else DraftTree(proposal, [])
                response.results.append(
                    draft_pb2.ProposeResult(request_id=item.request_id, draft_tokens=tree.tokens, parents=tree.parents)
                )
        return response

    async def Release(
        self, request: draft_pb2.DraftReleaseRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftReleaseResponse:
        await self._release(set(request.request_ids))
        return draft_pb2.DraftReleaseResponse()

    async def _release(self, released: set[str]) -> None:
        async with self._arrived:
            for key in [key for key in self._rows if key[0] in released]:
                del self._rows[key]
        await self._run(self.runner.release, list(released))
        self.leases.forget(list(released))

    async def sweep(self, interval_s: float) -> None:
        """Every `interval_s`: drops rows nobody asked for and frees the requests of orchestrators that are gone."""
        while True:
            await asyncio.sleep(interval_s)
            async with self._arrived:
                self._drop_stale_rows()
            orphans = self.leases.expired(time.monotonic())
            if orphans:
                LOG.warning("freeing %d requests of an orchestrator that went away", len(orphans))
                await self._release(set(orphans))

    async def stop(self) -> None:
        self.model_thread.shutdown()

    async def _take_rows(self, request_id: str, round_number: int, rows_end: int) -> TargetRows:
        """The request's rows up to this round: those of rounds it was not asked to draft for (the orchestrator
        chose k = 0 then) come first. Waits until this round's rows reach position `rows_end` (they may come in
        several messages: prompt chunks, a replay, bounded chunks of many rows). Raises DraftRequestError when they
        do not join up, CallFailed when the round's rows do not arrive in time."""
        key = (request_id, round_number)

        def arrived() -> bool:
            entry = self._rows.get(key)
            return entry is not None and entry[0].start_position + len(entry[0].next_tokens) >= rows_end

        async with self._arrived:
            self._drop_stale_rows()
            try:
                await asyncio.wait_for(self._arrived.wait_for(arrived), self.settings.rows_timeout_s)
            except TimeoutError:
                raise CallFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no hidden states from the target for request {request_id!r} round {round_number} "
                    f"within {self.settings.rows_timeout_s} s",
                ) from None
            earlier = sorted(k for k in self._rows if k[0] == request_id and k[1] < round_number)
            parts = [self._rows.pop(k)[0] for k in (*earlier, key)]
        rows = parts[0]
        for later in parts[1:]:
            # Rows that start where the earlier ones start, or before, restart the request (a recompute after
            # preemption, a replay): the earlier ones are stale, e.g. rows in flight when the request was released.
            rows = later if later.start_position <= rows.start_position else rows.followed_by(later)
        return rows

    def _drop_stale_rows(self) -> None:
        """Drops the rows of requests that got none for rows_ttl_s: rows of a request's last round arrive after it
        finished, and nobody asks for them. A running request that drafts nothing for a while (k = 0) keeps
        getting rows every round, so its rows stay until it drafts again."""
        latest: dict[str, float] = {}
        for (request_id, _), (_, arrived) in self._rows.items():
            latest[request_id] = max(arrived, latest.get(request_id, arrived))
        oldest = time.monotonic() - self.settings.rows_ttl_s
        for key in [key for key in self._rows if latest[key[0]] < oldest]:
            del self._rows[key]

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await self.model_thread.run(function, *args)


async def start_draft(settings: DraftSettings) -> tuple[DraftService, asyncio.Task[None], grpc.aio.Channel]:
    """Builds the replica against its target; raises IncompatibleDraft / AuxLayerError on a mismatch."""
    # Before any torch work on this thread (tandem.model_thread).
    model_thread = ModelThread("draft-model", settings.threads)
    security = settings.target_security
    await wait_for_ready(settings.target_address, timeout_s=300.0, open_channel=security.aio_channel)
    channel = security.aio_channel(settings.target_address)
    target = target_pb2_grpc.TargetStub(channel)
    info: target_pb2.TargetInfo = await target.GetInfo(target_pb2.TargetInfoRequest())
    LOG.info(
        "target: %s, hidden %d, vocab %d, %d layers",
        info.architecture,
        info.hidden_size,
        info.vocab_size,
        info.num_layers,
    )
    prepared = await model_thread.run(prepare_draft, settings, info)
    if prepared.missing_tables:
        tables = await pull_tables(target, prepared.missing_tables)
        for name, table in tables.items():
            await model_thread.run(prepared.fill_table, name, table.full())
    runner = await model_thread.run(prepared.build_runner, settings.cache)
    if settings.tree.topk > 1:
        if not isinstance(runner, DraftRunner):
            raise ConfigError(
                f"--speculative-eagle-topk {settings.tree.topk}: tree drafting needs an EAGLE3 or NextN head; "
                f"this draft is {prepared.kind!r}, which drafts chains (use --speculative-eagle-topk 1)"
            )
        runner = TreeDrafter(runner, settings.tree.topk, settings.tree.num_draft_tokens)
    LOG.info("%s draft ready, %d KV blocks", prepared.kind, runner.cache.num_blocks)
    service = DraftService(runner, settings, prepared, model_thread)
    stream = target.SubscribeHidden(
        target_pb2.SubscribeRequest(
            replica_id=settings.replica_id,
            capture_indices=list(prepared.capture.indices),
            tokens_only=prepared.tokens_only,
        )
    )
    consumer = asyncio.create_task(service.consume(stream))
    return service, consumer, channel
