"""A draft replica's start-up against its target: read the target's info, load the draft (draft_server.formats: check
compatibility, resolve the capture indices), pull the shared tables the checkpoint lacks from the target, subscribe
to the target's hidden-state stream, and subscribe again whenever that stream ends or breaks (`follow_target`)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from draft_server.formats import prepare_draft
from draft_server.service import DraftService
from draft_server.settings import DraftSettings
from draft_server.shared_tables import pull_tables
from tandem.grpc_util import wait_for_ready
from tandem.model_thread import ModelThread
from tandem.wire import target_pb2, target_pb2_grpc

LOG = logging.getLogger(__name__)
RESUBSCRIBE_S = (0.1, 5.0)  # the first wait before subscribing again, and the most (doubling in between)


async def start_draft(settings: DraftSettings) -> tuple[DraftService, list[asyncio.Task[None]], grpc.aio.Channel]:
    """Builds the replica against its target; raises IncompatibleDraft / AuxLayerError on a mismatch. Returns it
    with its essential task: the hidden-state stream from the target."""
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
    runner = await model_thread.run(prepared.build_proposer, settings.cache, settings.tree)
    LOG.info("%s draft ready, %d KV blocks", prepared.kind, runner.cache.num_blocks)
    service = DraftService(runner, settings, prepared, model_thread)
    subscribe = target_pb2.SubscribeRequest(
        replica_id=settings.replica_id,
        capture_indices=list(prepared.capture.indices),
        tokens_only=prepared.tokens_only,
        prefix_caching=runner.prefixes is not None,  # the target then skips what its own prefix cache holds
        prefix_shift=runner.prefixes.shift if runner.prefixes is not None else 0,
        image_embeddings=prepared.image_embeddings,
    )
    consumer = asyncio.create_task(
        follow_target(service, target, subscribe), name="hidden-state stream from the target"
    )
    return service, [consumer], channel


async def follow_target(
    service: DraftService, target: target_pb2_grpc.TargetStub, subscribe: target_pb2.SubscribeRequest
) -> None:
    """The target's hidden-state stream for the replica's whole life. A stream that ends or breaks (a reset link, a
    target restarted at its address) lost rows on the way: the replica drops what it held (its requests are
    replayed by their orchestrator) and subscribes again, waiting for the target with backoff. It never exits for
    that."""
    wait = RESUBSCRIBE_S[0]
    while True:
        received = False
        try:
            async for batch in target.SubscribeHidden(subscribe, wait_for_ready=True):
                received = True
                await service.store(batch)
            why = "ended"
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise  # the target refuses what this replica asks for: no retry helps
            why = f"broke ({error.code().name}: {error.details()})"
        wait = RESUBSCRIBE_S[0] if received else min(2 * wait, RESUBSCRIBE_S[1])
        lost = await service.lose_all()
        LOG.warning(
            "hidden-state stream from the target %s: %d requests dropped (replayed by their orchestrator); "
            "subscribing again in %.1f s",
            why,
            lost,
            wait,
        )
        await asyncio.sleep(wait)
