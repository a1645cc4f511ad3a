"""Entry point of one target process (what `tandem target` and a Kubernetes target pod run)."""

from __future__ import annotations

import logging
import time

import torch

from tandem.models.registry import load_target
from tandem.serving import ListenSettings, run_server
from tandem.wire import target_pb2, target_pb2_grpc
from target_server.runner import TargetRunner
from target_server.service import TargetService
from target_server.settings import TargetSettings

LOG = logging.getLogger(__name__)


def target_info(runner: TargetRunner, dtype: str) -> target_pb2.TargetInfo:
    """The static part of TargetInfo: what drafts check themselves against."""
    config = runner.model.config
    return target_pb2.TargetInfo(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        max_context=runner.max_context,
        dtype=dtype,
        eos_token_ids=list(config.eos_token_ids),
        tp_size=1,
    )


async def serve_target(settings: TargetSettings, listen: ListenSettings) -> None:
    started = time.perf_counter()
    LOG.info("loading target from %s (%s)", settings.model_dir, settings.dtype)
    model = load_target(settings.model_dir, dtype=getattr(torch, settings.dtype))
    config = model.config
    max_context = min(settings.max_context or config.max_position_embeddings, config.max_position_embeddings)
    LOG.info(
        "loaded %s: %d layers, hidden %d, vocab %d in %.1f s",
        config.architecture,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        time.perf_counter() - started,
    )
    runner = TargetRunner(model, settings.cache, max_context)
    service = TargetService(runner, target_info(runner, settings.dtype))
    await run_server(
        "target",
        lambda server: target_pb2_grpc.add_TargetServicer_to_server(service, server),
        ["tandem.v1.Target"],
        listen,
        on_stop=service.stop,
    )
