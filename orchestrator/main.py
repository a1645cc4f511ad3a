"""Entry point of the orchestrator process (what `tandem orchestrator` and its Kubernetes pod run)."""

from __future__ import annotations

import grpc

from orchestrator.service import OrchestratorSettings, start_orchestrator
from tandem.serving import ListenSettings, run_server
from tandem.wire import orchestrator_pb2_grpc


async def serve_orchestrator(settings: OrchestratorSettings, listen: ListenSettings) -> None:
    service, admin, loop_task = await start_orchestrator(settings)
    loop_task.set_name("scheduler loop")

    def register(server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(service, server)
        orchestrator_pb2_grpc.add_OrchestratorAdminServicer_to_server(admin, server)

    await run_server(
        "orchestrator",
        register,
        ["tandem.v1.Orchestrator", "tandem.v1.OrchestratorAdmin"],
        listen,
        background=[loop_task],
    )
