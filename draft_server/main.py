"""Entry point of one draft replica process (what `tandem draft` and a Kubernetes draft pod run)."""

from __future__ import annotations

import asyncio

from draft_server.service import DraftService, DraftSettings, start_draft
from tandem.leases import sweep_interval
from tandem.service_metrics import ServiceMetrics, model_service_metrics, serve_metrics
from tandem.serving import ListenSettings, run_server
from tandem.wire import draft_pb2_grpc


async def serve_draft(settings: DraftSettings, listen: ListenSettings) -> None:
    service, consumer, channel = await start_draft(settings)
    consumer.set_name("hidden-state stream from the target")
    timeout_s = settings.cache.orphan_timeout_s
    sweeper = asyncio.create_task(service.sweep(sweep_interval(timeout_s)), name="draft sweep")
    port = settings.metrics_port
    metrics_server = serve_metrics(draft_metrics(service), listen.host, port)[0] if port is not None else None

    async def on_stop() -> None:
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.shutdown)
        await service.stop()
        await channel.close()

    await run_server(
        f"draft {settings.replica_id}",
        lambda server: draft_pb2_grpc.add_DraftServicer_to_server(service, server),
        ["tandem.v1.Draft"],
        listen,
        on_stop=on_stop,
        background=[consumer, sweeper],
    )


def draft_metrics(service: DraftService) -> ServiceMetrics:
    """The draft's /metrics (tandem.service_metrics): Propose compute time, KV usage, requests, model-thread queue."""
    return model_service_metrics("draft", "propose", service.runner, service.model_thread, service.propose_listeners)
