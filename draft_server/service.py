"""A draft replica's gRPC service and its start-up against the target.

Start-up: read the target's info, load the head, check compatibility, resolve the aux capture
indices, pull the embedding from the target if the checkpoint has none, subscribe to the target's
hidden-state stream. Per round, Propose joins the orchestrator's request with the target's rows for
the same (request id, round) and runs the runner on one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import torch

from draft_server.compat import check_compatibility
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput, TargetRows
from draft_server.settings import DraftSettings
from tandem.grpc_util import channel_options, wait_for_ready
from tandem.models.aux_layers import CaptureSpec, resolve_capture
from tandem.models.eagle3 import Eagle3Draft, load_eagle3
from tandem.models.registry import target_architecture
from tandem.wire import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire.codec import WeightAssembler, tensor_from_proto

LOG = logging.getLogger(__name__)
T = TypeVar("T")


class DraftService(draft_pb2_grpc.DraftServicer):
    def __init__(self, runner: DraftRunner, settings: DraftSettings, capture: CaptureSpec) -> None:
        self.runner = runner
        self.settings = settings
        self.capture = capture
        self._rows: dict[tuple[str, int], tuple[TargetRows, float]] = {}
        self._arrived = asyncio.Condition()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")

    async def consume(self, stream: AsyncIterator[target_pb2.HiddenStates]) -> None:
        """Stores the target's rows as they arrive, keyed by (request id, round)."""
        async for message in stream:
            rows = TargetRows(message.start_position, list(message.next_tokens), tensor_from_proto(message.features))
            async with self._arrived:
                self._rows[(message.request_id, message.round)] = (rows, time.monotonic())
                self._arrived.notify_all()

    async def GetInfo(
        self, request: draft_pb2.DraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftInfo:
        return draft_pb2.DraftInfo(
            replica_id=self.settings.replica_id,
            architecture=type(self.runner.model).__name__,
            num_steps=self.settings.num_steps,
            capture_indices=list(self.capture.indices),
            running_requests=len(self.runner.requests),
            kv_blocks_total=self.runner.cache.num_blocks,
            kv_blocks_free=self.runner.cache.num_free_blocks,
        )

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        inputs = []
        for item in request.items:
            rows = await self._take_rows(item.request_id, item.round)
            if rows is None:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no hidden states from the target for request {item.request_id!r} round {item.round} "
                    f"within {self.settings.rows_timeout_s} s",
                )
                raise AssertionError("unreachable")
            inputs.append(ProposeInput(item.request_id, rows, item.num_steps or self.settings.num_steps))
        started = time.perf_counter()
        try:
            proposals = await self._run(self.runner.propose, inputs)
        except DraftRequestError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return draft_pb2.ProposeResponse(
            results=[
                draft_pb2.ProposeResult(request_id=item.request_id, draft_tokens=tokens)
                for item, tokens in zip(request.items, proposals, strict=True)
            ],
            compute_seconds=time.perf_counter() - started,
        )

    async def Release(
        self, request: draft_pb2.DraftReleaseRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftReleaseResponse:
        released = set(request.request_ids)
        async with self._arrived:
            for key in [key for key in self._rows if key[0] in released]:
                del self._rows[key]
        await self._run(self.runner.release, list(released))
        return draft_pb2.DraftReleaseResponse()

    async def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _take_rows(self, request_id: str, round_number: int) -> TargetRows | None:
        key = (request_id, round_number)
        async with self._arrived:
            self._drop_stale_rows()
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: key in self._rows), self.settings.rows_timeout_s)
            except TimeoutError:
                return None
            return self._rows.pop(key)[0]

    def _drop_stale_rows(self) -> None:
        # Rows of a request's last round arrive after it finished; nobody asks for them.
        oldest = time.monotonic() - self.settings.rows_ttl_s
        for key in [key for key, (_, arrived) in self._rows.items() if arrived < oldest]:
            del self._rows[key]

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)


async def start_draft(settings: DraftSettings) -> tuple[DraftService, asyncio.Task[None], grpc.aio.Channel]:
    """Builds the replica against its target; raises IncompatibleDraft / AuxLayerError on a mismatch."""
    await wait_for_ready(settings.target_address, timeout_s=300.0)
    channel = grpc.aio.insecure_channel(settings.target_address, options=channel_options())
    target = target_pb2_grpc.TargetStub(channel)
    info: target_pb2.TargetInfo = await target.GetInfo(target_pb2.TargetInfoRequest())
    LOG.info(
        "target: %s, hidden %d, vocab %d, %d layers",
        info.architecture,
        info.hidden_size,
        info.vocab_size,
        info.num_layers,
    )
    model, capture, has_embedding = prepare_draft(settings, info)
    if not has_embedding:
        embedding = await pull_weight(target, "embed_tokens")
        model.embed_tokens.weight.data.copy_(embedding)
    runner = DraftRunner(model, settings.cache)
    service = DraftService(runner, settings, capture)
    stream = target.SubscribeHidden(
        target_pb2.SubscribeRequest(replica_id=settings.replica_id, capture_indices=list(capture.indices))
    )
    consumer = asyncio.create_task(service.consume(stream))
    return service, consumer, channel


def prepare_draft(settings: DraftSettings, info: target_pb2.TargetInfo) -> tuple[Eagle3Draft, CaptureSpec, bool]:
    """Loads the head, checks it against the target and resolves its capture indices.

    Returns (model, capture, has_embedding); without an embedding in the checkpoint the caller fills
    `model.embed_tokens` from the target.
    """
    model, has_embedding = load_eagle3(settings.model_dir, dtype=getattr(torch, settings.dtype))
    check_compatibility(model.config, info, has_embedding)
    capture = resolve_capture(
        model.config.aux_layer_ids,
        info.num_layers,
        model.config.num_aux,
        settings.aux_layer_convention,
        default_indices=target_architecture(info.architecture).default_capture_indices,
    )
    return model, capture, has_embedding


async def pull_weight(target: target_pb2_grpc.TargetStub, name: str) -> torch.Tensor:
    """Streams one shared table from the target, logging progress every quarter."""
    reported: dict[str, int] = {}

    def progress(tensor_name: str, received: int, total: int) -> None:
        quarter = 4 * received // max(total, 1)
        if reported.get(tensor_name) != quarter:
            reported[tensor_name] = quarter
            LOG.info("pulling %s from the target: %d / %d bytes", tensor_name, received, total)

    assembler = WeightAssembler(progress=progress)
    result = None
    async for chunk in target.GetWeights(target_pb2.WeightsRequest(names=[name])):
        completed = assembler.add(chunk)
        if completed is not None:
            result = completed[1]
    assembler.finish()
    if result is None:
        raise RuntimeError(f"the target sent no {name}")
    return result
