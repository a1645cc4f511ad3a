"""Entry point of one target process (what `tandem target` and a Kubernetes target pod run).

With tp > 1 this process is rank 0: it starts and joins the other ranks (target_server.ranks), serves gRPC, and stops
them when it stops; it also stops, exit code 1, when one of them dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from tandem.devices import rank_device
from tandem.errors import StartupError
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.matmul import prepackable_linears
from tandem.layers.stored import StoredWeight
from tandem.leases import sweep_interval
from tandem.model_thread import ModelThread
from tandem.models.image_encoder import ImageEncoder, image_encoder_for
from tandem.models.image_prompt import FixedCount, ImagePrompt, PatchBudget, SoftTokenBudget
from tandem.models.registry import TargetModel, check_tensor_parallel, load_target
from tandem.models.tokenizer_digest import tokenizer_digest
from tandem.sampling.grammar import Grammars
from tandem.service_metrics import ServiceMetrics, model_service_metrics, serve_metrics
from tandem.serving import ListenSettings, run_server
from tandem.wire import target_pb2, target_pb2_grpc
from target_server.ranks import RankDriver, start_ranks
from target_server.runner import TargetRunner
from target_server.service import TargetService
from target_server.settings import TargetSettings

LOG = logging.getLogger(__name__)
RANK_POLL_S = 0.5


def target_info(runner: TargetRunner, dtype: str) -> target_pb2.TargetInfo:
    """The static part of TargetInfo: what drafts check themselves against, and how prompts hold images."""
    config = runner.model.config
    encoder = runner.admission.images
    limit = runner.admission.image_limit
    images = image_layout(encoder.prompt, limit) if encoder is not None and limit > 0 else None
    return target_pb2.TargetInfo(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        max_context=runner.max_context,
        dtype=dtype,
        eos_token_ids=list(config.eos_token_ids),
        tp_size=runner.ranks.group.world_size,
        instance=uuid.uuid4().hex,
        images=images,
        kept_kv=[target_pb2.KeptKV(**asdict(kept)) for kept in runner.model.kept_kv],
    )


def image_layout(prompt: ImagePrompt, limit: int) -> target_pb2.ImageLayout:
    """The prompt's layout as TargetInfo announces it (orchestrator.loop.prompt_images reads it back)."""
    count = prompt.count
    counts: dict[str, Any] = {"tokens_per_image": count.tokens_per_image} if isinstance(count, FixedCount) else {}
    if isinstance(count, SoftTokenBudget):
        counts = {"soft_token_budget": target_pb2.SoftTokenBudget(**asdict(count))}
    elif isinstance(count, PatchBudget):
        counts = {"patch_budget": target_pb2.PatchBudget(**asdict(count))}
    return target_pb2.ImageLayout(
        limit=limit,
        begin_token_id=prompt.begin_token_id,
        image_token_id=prompt.image_token_id,
        end_token_id=prompt.end_token_id,
        mark_token_id=prompt.mark_token_id,
        around=prompt.around,
        pan_and_scan=None if prompt.pan_and_scan is None else target_pb2.PanAndScan(**asdict(prompt.pan_and_scan)),
        **counts,
    )


def start_target(settings: TargetSettings) -> TargetRunner:
    """Rank 0: starts and joins the other ranks (none with tp 1), loads this rank's shard, waits for theirs."""
    started = time.perf_counter()
    if settings.tp < 1:
        raise StartupError(f"tp: {settings.tp} (must be >= 1)")
    if settings.tp > 1:
        # Refuses an unfit tp (one that cuts a quantized block, too) before any rank starts.
        check_tensor_parallel(settings.model_dir, settings.tp, settings.dequantize)
    device = rank_device(settings.device, 0)
    ranks = start_ranks(settings, torch.device(device))
    try:
        LOG.info(
            "rank 0/%d: loading target from %s (%s on %s)", settings.tp, settings.model_dir, settings.dtype, device
        )
        dtype = getattr(torch, settings.dtype)
        model = load_target(settings.model_dir, dtype, device, ranks.group, settings.dequantize)
        ranks.wait_until_loaded()
    except BaseException:
        ranks.abort()
        raise
    config = model.config
    max_context = min(settings.max_context or config.max_position_embeddings, config.max_position_embeddings)
    LOG.info(
        "loaded %s: %d layers, hidden %d, vocab %d, tp %d in %.1f s",
        config.architecture,
        config.num_layers,
        config.hidden_size,
        config.vocab_size,
        settings.tp,
        time.perf_counter() - started,
    )
    grammars = Grammars(settings.model_dir, config.vocab_size)  # its tokenizer is read when a grammar first comes
    images = image_encoder(settings, dtype, device)
    runner = TargetRunner(
        model, settings.cache, max_context, ranks, grammars=grammars, images=images, image_limit=settings.images
    )
    LOG.info("%s; %s", weights_line(runner.model), kv_line(runner.cache))
    return runner


def image_encoder(settings: TargetSettings, dtype: torch.dtype, device: str) -> ImageEncoder | None:
    """The checkpoint's image encoder on rank 0 (tandem.models.image_encoder), unless no image is allowed; None."""
    if settings.images == 0:
        return None
    encoder = image_encoder_for(settings.model_dir, dtype, device)
    if encoder is not None:
        LOG.info("image encoder loaded: %s, at most %d images a prompt", encoder.prompt.count, settings.images)
    return encoder


def weights_line(model: TargetModel) -> str:
    """What rank 0 holds of the weights, by kind: quantized weights as stored (scales included), float weights and
    buffers (a tied table once), and oneDNN's copies of float linear weights (tandem.layers.matmul.prepack)."""
    assert isinstance(model, nn.Module)
    stored = {
        id(tensor) for module in model.modules() if isinstance(module, StoredWeight) for tensor in module.buffers()
    }
    held = [*model.parameters(), *model.buffers()]
    quantized = sum(tensor.nbytes for tensor in held if id(tensor) in stored)
    floats = sum(tensor.nbytes for tensor in held if id(tensor) not in stored)
    copies = sum(module.prepacked.nbytes for module in prepackable_linears(model) if module.prepacked is not None)
    return (
        f"weights per rank: {_size(quantized)} quantized as stored, {_size(floats)} float, {_size(copies)} oneDNN "
        "copies"
    )


def kv_line(cache: PagedKVCache) -> str:
    return (
        f"KV cache: {cache.num_blocks} blocks of {cache.block_size} tokens ({cache.num_blocks * cache.block_size} "
        f"tokens), {_size(cache.keys.nbytes + cache.values.nbytes)} per rank"
    )


def _size(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


async def serve_target(settings: TargetSettings, listen: ListenSettings) -> None:
    # Before any torch work on this thread (tandem.model_thread).
    model_thread = ModelThread("target-model", settings.threads)
    runner = await model_thread.run(start_target, settings)
    ranks = runner.ranks
    timeout_s = settings.cache.orphan_timeout_s
    info = target_info(runner, settings.dtype)
    info.tokenizer_digest = tokenizer_digest(settings.model_dir)  # what standalone drafts check their own against
    service = TargetService(runner, info, model_thread, timeout_s)
    port = settings.metrics_port
    metrics_server = serve_metrics(target_metrics(service), listen.host, port)[0] if port is not None else None

    async def stop() -> None:
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)
        await service.stop()
        await asyncio.to_thread(ranks.stop)  # waits for a forward pass in flight, then stops the other ranks

    watch = [asyncio.create_task(watch_ranks(ranks), name="target ranks")] if ranks.processes else []
    watch.append(asyncio.create_task(service.sweep_orphans(sweep_interval(timeout_s)), name="orphan sweep"))
    await run_server(
        "target",
        lambda server: target_pb2_grpc.add_TargetServicer_to_server(service, server),
        ["tandem.v1.Target"],
        listen,
        on_stop=stop,
        background=watch,
    )


def target_metrics(service: TargetService) -> ServiceMetrics:
    """The target's /metrics (tandem.service_metrics): step compute time, KV usage, requests, model-thread queue."""
    return model_service_metrics("target", "step", service.runner, service.model_thread, service.step_listeners)


async def watch_ranks(ranks: RankDriver) -> None:
    """Ends, raising RankFailed, when a rank process exits while the target serves: run_server then stops."""
    while True:
        if not ranks.stopping:
            ranks.check_running()
        await asyncio.sleep(RANK_POLL_S)
