"""Entry point of one draft replica process (what `tandem draft` and a Kubernetes draft pod run)."""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

from draft_server.service import DraftService, DraftSettings
from draft_server.startup import start_draft
from tandem.leases import sweep_interval
from tandem.service_metrics import ServiceMetrics, model_service_metrics, serve_metrics
from tandem.serving import ListenSettings, run_server
from tandem.wire import draft_pb2_grpc

# Seconds a Propose waits for hidden rows: usually well under a millisecond; it gives up at rows_timeout_s (60 s).
ROWS_WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)


async def serve_draft(settings: DraftSettings, listen: ListenSettings) -> None:
    service, streams, channel = await start_draft(settings)
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
        background=[*streams, sweeper],
    )


def draft_metrics(service: DraftService) -> ServiceMetrics:
    """The draft's /metrics (tandem.service_metrics): Propose compute time, KV usage, requests, model-thread queue,
    and how long each Propose waited for the target's hidden rows."""
    metrics = model_service_metrics("draft", "propose", service.runner, service.model_thread, service.propose_listeners)
    rows_wait = Histogram(
        "tandem:draft_hidden_rows_wait_seconds",
        "Time a Propose call waited for the target's hidden rows of its requests to reach their rows_end "
        "(the hidden-row lag between target and draft; near 0 while the rows arrive before the call)",
        registry=metrics.registry,
        buckets=ROWS_WAIT_BUCKETS,
    )
    service.rows_wait_listeners.append(rows_wait.observe)
    return metrics
