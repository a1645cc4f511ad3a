"""The public Orchestrator service: validates, tokenizes, hands requests to the scheduler, streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from transformers import AutoTokenizer

from orchestrator.admin import AdminService
from orchestrator.backends import DraftBackend, FailureKind
from orchestrator.batching import KVPool
from orchestrator.grpc_backends import GrpcDraft, GrpcTarget
from orchestrator.output import Output, RequestFailed
from orchestrator.replicas import ReplicaPool
from orchestrator.scheduler import QueueFull, Scheduler, TargetFacts
from orchestrator.settings import OrchestratorSettings
from orchestrator.validation import InvalidRequest, Limits, check_bounds, validate_request
from tandem.grpc_util import channel_options, wait_for_ready
from tandem.wire import draft_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc

LOG = logging.getLogger(__name__)

STATUS_OF_FAILURE = {
    FailureKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FailureKind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def response_message(output: Output) -> orchestrator_pb2.GenerateResponse:
    response = orchestrator_pb2.GenerateResponse(
        token_ids=output.token_ids, text=output.text, finish_reason=output.finish_reason
    )
    if output.stats is not None:
        stats = output.stats
        response.stats.CopyFrom(
            orchestrator_pb2.GenerateStats(
                rounds=stats.rounds,
                draft_tokens=stats.draft_tokens,
                accepted_tokens=stats.accepted_tokens,
                prompt_tokens=output.prompt_tokens,
                completion_tokens=output.completion_tokens,
                accepted_per_position=stats.accepted_per_position,
                draft_seconds=stats.draft_seconds,
                verify_seconds=stats.verify_seconds,
                wire_seconds=stats.wire_seconds,
                scheduling_seconds=stats.scheduling_seconds,
            )
        )
    return response


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, scheduler: Scheduler, limits: Limits) -> None:
        self.scheduler = scheduler
        self.limits = limits

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        try:
            check_bounds(request, self.limits)
            # Tokenizing a long prompt takes a while: off the event loop, which keeps streaming to other clients.
            params = await asyncio.to_thread(validate_request, request, self.scheduler.tokenizer, self.limits)
            active = self.scheduler.submit(params)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            return
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
            return
        try:
            while True:
                output = await active.output.messages.get()
                if isinstance(output, RequestFailed):
                    await context.abort(STATUS_OF_FAILURE[output.kind], str(output))
                    return
                yield response_message(output)
                if output.finish_reason:
                    return
        finally:
            # Reached on cancellation too (the client went away): free the request's KV everywhere.
            self.scheduler.cancel(active)


async def connect_replica(address: str, call_timeout_s: float, timeout_s: float = 30.0) -> tuple[str, DraftBackend]:
    """Connects to a draft replica and returns its id (from GetInfo) and a backend for it."""
    channel = grpc.aio.insecure_channel(address, options=channel_options())
    stub = draft_pb2_grpc.DraftStub(channel)
    draft: draft_pb2.DraftInfo = await stub.GetInfo(
        draft_pb2.DraftInfoRequest(), wait_for_ready=True, timeout=timeout_s
    )
    LOG.info("draft replica %s at %s: %s, %d steps", draft.replica_id, address, draft.architecture, draft.num_steps)
    return draft.replica_id, GrpcDraft(stub, call_timeout_s)


async def start_orchestrator(
    settings: OrchestratorSettings,
) -> tuple[OrchestratorService, AdminService, asyncio.Task[None]]:
    await wait_for_ready(settings.target_address, timeout_s=600.0)
    target_channel = grpc.aio.insecure_channel(settings.target_address, options=channel_options())
    target_stub = target_pb2_grpc.TargetStub(target_channel)
    info: target_pb2.TargetInfo = await target_stub.GetInfo(target_pb2.TargetInfoRequest())
    replicas = ReplicaPool()
    draft_timeout_s = settings.scheduler.draft_timeout_s
    for address in settings.draft_addresses:
        replica_id, backend = await connect_replica(address, draft_timeout_s, timeout_s=600.0)
        replicas.add(replica_id, address, backend)
    tokenizer = AutoTokenizer.from_pretrained(str(settings.tokenizer_dir))
    eos_ids = set(info.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    facts = TargetFacts(info.vocab_size, KVPool(info.kv_blocks_total, info.kv_block_size), info.max_draft_tokens)
    target = GrpcTarget(target_stub, settings.scheduler.target_timeout_s)
    scheduler = Scheduler(target, replicas, tokenizer, eos_ids, settings.scheduler, facts)
    limits = Limits(
        vocab_size=info.vocab_size,
        max_context=info.max_context,
        default_max_new_tokens=settings.default_max_new_tokens,
    )
    loop_task = asyncio.create_task(scheduler.run())
    scaler = None
    if settings.scaler_address:
        scaler_channel = grpc.aio.insecure_channel(settings.scaler_address, options=channel_options())
        scaler = orchestrator_pb2_grpc.ScalerStub(scaler_channel)
    admin = AdminService(scheduler, lambda address: connect_replica(address, draft_timeout_s), scaler)
    return OrchestratorService(scheduler, limits), admin, loop_task
