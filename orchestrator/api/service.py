"""The public Orchestrator service (gRPC Generate, a front end of orchestrator.loop.generation) and its start-up."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

import grpc

from orchestrator.api.admin import AdminService
from orchestrator.api.tokenizer import load_tokenizer
from orchestrator.loop.batching import KVPool
from orchestrator.loop.generation import Generation
from orchestrator.loop.hybrid import with_hybrid
from orchestrator.loop.metrics import Metrics
from orchestrator.loop.ngram import add_ngram_replica, check_one_draft_kind
from orchestrator.loop.output import Output, RequestFailed
from orchestrator.loop.prompt_images import ImageLayout
from orchestrator.loop.scheduler import QueueFull, Scheduler, TargetFacts
from orchestrator.loop.validation import InvalidRequest, Limits, client_request_id
from orchestrator.peers.backends import DraftBackend, FailureKind
from orchestrator.peers.discovery import DnsResolver, DraftDiscovery
from orchestrator.peers.grpc_backends import GrpcDraft, GrpcTarget
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import OrchestratorSettings, SchedulerSettings
from tandem.grpc_util import closed_at_call_end, wait_for_ready
from tandem.transport import TransportSecurity
from tandem.wire import draft_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc
from tandem.wire.logprobs import logprobs_to_proto

LOG = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0  # for the target, and each --draft-address, to answer at start-up (they may be loading)
ADMIN_CONNECT_TIMEOUT_S = 30.0  # for a replica added on the admin port to answer

REQUEST_ID_METADATA = "x-request-id"  # the client's id for its request, echoed in the initial metadata

STATUS_OF_FAILURE = {
    FailureKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FailureKind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def response_message(output: Output) -> orchestrator_pb2.GenerateResponse:
    response = orchestrator_pb2.GenerateResponse(
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=output.finish_reason,
        logprobs=logprobs_to_proto(output.logprobs),
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
                cached_tokens=stats.cached_tokens,
            )
        )
    return response


class OrchestratorService(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        # A client that goes away ends the call: its request is cancelled then, freeing its KV everywhere.
        try:
            given = dict(context.invocation_metadata() or ()).get(REQUEST_ID_METADATA)
            client_id = client_request_id(given if isinstance(given, str) else None)
            await context.send_initial_metadata(((REQUEST_ID_METADATA, client_id),))
            outputs = closed_at_call_end(context, self.generation.stream(request, client_id))
            async with aclosing(outputs):
                async for output in outputs:
                    yield response_message(output)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except RequestFailed as failure:
            await context.abort(STATUS_OF_FAILURE[failure.kind], str(failure))


async def connect_replica(
    address: str,
    call_timeout_s: float,
    timeout_s: float = ADMIN_CONNECT_TIMEOUT_S,
    session: str = "",
    *,
    security: TransportSecurity,
    scheduler: SchedulerSettings,
) -> tuple[str, DraftBackend]:
    """Connects to a draft replica and returns its id (from GetInfo) and a backend for it (with --hybrid-ngram, one
    that merges n-gram drafts into its answers); `session` names this orchestrator to the replica (tandem.leases)."""
    channel = security.aio_channel(address)
    stub = draft_pb2_grpc.DraftStub(channel)
    try:
        draft: draft_pb2.DraftInfo = await stub.GetInfo(
            draft_pb2.DraftInfoRequest(), wait_for_ready=True, timeout=timeout_s
        )
    except BaseException:
        await channel.close()  # draft discovery retries an address that does not answer: no channel piles up
        raise
    LOG.info(
        "draft replica %s at %s: %s (%s), %d steps",
        draft.replica_id,
        address,
        draft.architecture,
        draft.kind,
        draft.num_steps,
    )
    backend = GrpcDraft(stub, call_timeout_s, session, draft.kind)
    return draft.replica_id, with_hybrid(backend, scheduler)


async def start_orchestrator(
    settings: OrchestratorSettings,
) -> tuple[OrchestratorService, AdminService, list[asyncio.Task[None]]]:
    """Connects to the target and the given drafts; returns the services and the essential background tasks."""
    check_one_draft_kind(settings)
    security = settings.internal_security
    await wait_for_ready(settings.target_address, timeout_s=STARTUP_TIMEOUT_S, open_channel=security.aio_channel)
    target_stub = target_pb2_grpc.TargetStub(security.aio_channel(settings.target_address))
    info: target_pb2.TargetInfo = await target_stub.GetInfo(target_pb2.TargetInfoRequest())
    # New at every start: the target and drafts free the requests of an earlier run of this orchestrator.
    session = uuid.uuid4().hex

    def connect(
        address: str, timeout_s: float = ADMIN_CONNECT_TIMEOUT_S, over: TransportSecurity = security
    ) -> Awaitable[tuple[str, DraftBackend]]:
        call_timeout_s = settings.scheduler.draft_timeout_s
        return connect_replica(address, call_timeout_s, timeout_s, session, security=over, scheduler=settings.scheduler)

    replicas = ReplicaPool()
    for address in settings.draft_addresses:
        replica_id, backend = await connect(address, STARTUP_TIMEOUT_S)
        replicas.add(replica_id, address, backend)
    if settings.ngram is not None:
        add_ngram_replica(replicas, settings.ngram)
    tokenizer = load_tokenizer(settings.tokenizer_dir)
    eos_ids = set(info.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    facts = TargetFacts(info.vocab_size, KVPool(info.kv_blocks_total, info.kv_block_size), info.max_draft_tokens)
    target = GrpcTarget(target_stub, settings.scheduler.target_timeout_s, session, info.instance)
    scheduler = Scheduler(target, replicas, tokenizer, eos_ids, settings.scheduler, facts)
    limits = Limits(
        info.vocab_size, info.max_context, settings.default_max_new_tokens, images=ImageLayout.announced(info)
    )
    metrics = Metrics(scheduler, settings.model_name)
    background = [
        asyncio.create_task(scheduler.run(), name="scheduler loop"),
        asyncio.create_task(metrics.acceptance.run(), name="acceptance watch"),
    ]
    discovery = None
    if settings.draft_discovery is not None:
        found_by = settings.draft_discovery
        found_security = security.with_server_name(found_by.tls_server_name)  # found replicas are dialled by IP
        discovery = DraftDiscovery(
            found_by,
            DnsResolver(),
            lambda address: connect(address, found_by.connect_timeout_s, found_security),
            replicas,
            scheduler.wake,
        )
        background.append(asyncio.create_task(discovery.run(), name="draft discovery"))
    admin = AdminService(
        scheduler,
        connect,
        _scaler(settings, security),
        max_draft_replicas=settings.admin.max_draft_replicas,
        allowed_addresses=(*settings.admin.allowed_draft_addresses, *settings.draft_addresses),
        discovery=discovery,
    )
    return OrchestratorService(Generation(scheduler, limits, metrics)), admin, background


def _scaler(settings: OrchestratorSettings, security: TransportSecurity) -> orchestrator_pb2_grpc.ScalerStub | None:
    """The launcher's Scaler (tandem scale), when the stack was started by one."""
    if not settings.scaler_address:
        return None
    return orchestrator_pb2_grpc.ScalerStub(security.aio_channel(settings.scaler_address))
