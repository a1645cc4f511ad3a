"""Entry point of the orchestrator process (what `tandem orchestrator` and its Kubernetes pod run)."""

from __future__ import annotations

from orchestrator.service import OrchestratorSettings, start_orchestrator
from tandem.serving import ListenSettings, run_server
from tandem.wire import orchestrator_pb2_grpc


async def serve_orchestrator(settings: OrchestratorSettings, listen: ListenSettings) -> None:
    service, loop_task = await start_orchestrator(settings)
    loop_task.set_name("scheduler loop")
    await run_server(
        "orchestrator",
        lambda server: orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(service, server),
        ["tandem.v1.Orchestrator"],
        listen,
        background=[loop_task],
    )
