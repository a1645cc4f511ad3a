"""Entry point of one draft replica process (what `tandem draft` and a Kubernetes draft pod run)."""

from __future__ import annotations

from draft_server.service import DraftSettings, start_draft
from tandem.serving import ListenSettings, run_server
from tandem.wire import draft_pb2_grpc


async def serve_draft(settings: DraftSettings, listen: ListenSettings) -> None:
    service, consumer, channel = await start_draft(settings)
    consumer.set_name("hidden-state stream from the target")

    async def on_stop() -> None:
        await service.stop()
        await channel.close()

    await run_server(
        f"draft {settings.replica_id}",
        lambda server: draft_pb2_grpc.add_DraftServicer_to_server(service, server),
        ["tandem.v1.Draft"],
        listen,
        on_stop=on_stop,
        background=[consumer],
    )
