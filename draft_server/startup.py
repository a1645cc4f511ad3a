"""A draft replica's start-up against its target: read the target's info, load the draft (draft_server.formats: check
compatibility, resolve the capture indices), pull the shared tables the checkpoint lacks from the target, subscribe
to the target's hidden-state stream."""

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
    stream = target.SubscribeHidden(
        target_pb2.SubscribeRequest(
            replica_id=settings.replica_id,
            capture_indices=list(prepared.capture.indices),
            tokens_only=prepared.tokens_only,
        )
    )
    consumer = asyncio.create_task(service.consume(stream), name="hidden-state stream from the target")
    return service, [consumer], channel
