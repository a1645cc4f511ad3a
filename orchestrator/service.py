"""The public Orchestrator service: validates, tokenizes, hands requests to the scheduler, streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from transformers import AutoTokenizer

from orchestrator.replicas import ReplicaPool
from orchestrator.scheduler import RequestFailed, Scheduler
from orchestrator.settings import OrchestratorSettings
from orchestrator.validation import InvalidRequest, Limits, validate_request
from tandem.grpc_util import channel_options, wait_for_ready
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc

LOG = logging.getLogger(__name__)


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, scheduler: Scheduler, limits: Limits) -> None:
        self.scheduler = scheduler
        self.limits = limits

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        try:
            params = validate_request(request, self.scheduler.tokenizer, self.limits)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            return
        active = self.scheduler.submit(params)
        try:
            while True:
                message = await active.outputs.get()
                if isinstance(message, RequestFailed):
                    await context.abort(message.code, str(message))
                    return
                yield message
                if message.finish_reason:
                    return
        finally:
            # Reached on cancellation too (the client went away): free the request's KV everywhere.
            self.scheduler.cancel(active)


async def start_orchestrator(settings: OrchestratorSettings) -> tuple[OrchestratorService, asyncio.Task[None]]:
    await wait_for_ready(settings.target_address, timeout_s=600.0)
    channel = grpc.aio.insecure_channel(settings.target_address, options=channel_options())
    target = target_pb2_grpc.TargetStub(channel)
    info: target_pb2.TargetInfo = await target.GetInfo(target_pb2.TargetInfoRequest())
    replicas = ReplicaPool()
    for address in settings.draft_addresses:
        draft = await replicas.connect(address)
        LOG.info("draft replica %s at %s: %s, %d steps", draft.replica_id, address, draft.architecture, draft.num_steps)
    tokenizer = AutoTokenizer.from_pretrained(str(settings.tokenizer_dir))
    eos_ids = set(info.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    scheduler = Scheduler(target, replicas, tokenizer, eos_ids, settings.scheduler)
    limits = Limits(
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        default_max_new_tokens=settings.default_max_new_tokens,
    )
    loop_task = asyncio.create_task(scheduler.run())
    return OrchestratorService(scheduler, limits), loop_task
