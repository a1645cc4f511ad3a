"""Entry point of the orchestrator process (what `tandem orchestrator` and its Kubernetes pod run)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import time

import grpc

from orchestrator.api.http_api import serve_http_api
from orchestrator.api.service import OrchestratorSettings, start_orchestrator
from orchestrator.settings import AdminSettings
from tandem.auth import BearerInterceptor
from tandem.errors import StartupError
from tandem.serving import ListenSettings, run_server, start_server
from tandem.wire import orchestrator_pb2_grpc

LOG = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def check_admin_settings(admin: AdminSettings) -> None:
    """Refuses an admin port reachable from other machines without a token, and a bound below zero."""
    if admin.token is None and not is_loopback(admin.host):
        raise StartupError(
            f"--admin-host {admin.host}: the admin port is reachable from other machines; set --admin-token "
            "(or TANDEM_ADMIN_TOKEN), or keep it on loopback"
        )
    if admin.max_draft_replicas < 0:
        raise StartupError(f"--max-draft-replicas: {admin.max_draft_replicas} < 0")


async def serve_orchestrator(settings: OrchestratorSettings, listen: ListenSettings) -> None:
    check_admin_settings(settings.admin)
    listen = dataclasses.replace(listen, max_message_bytes=settings.max_request_bytes)
    service, admin, background = await start_orchestrator(settings)
    # Before the gRPC ready file: once it exists, the HTTP API's does too. Same security as the public port: with
    # its TLS, HTTPS with the same certificate (the API key crosses the network on HTTP too).
    http = await serve_http_api(settings, listen.host, listen.security, service.generation)

    def register(server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(service, server)

    # OrchestratorAdmin has its own server (its own port and token), started first: once the public port's ready
    # file exists, the admin's does too.
    admin_listen = ListenSettings(
        settings.admin.host, settings.admin.port, settings.admin.ready_file, security=listen.security
    )
    admin_token = settings.admin.token
    admin_server, admin_health, admin_address = await start_server(
        lambda server: orchestrator_pb2_grpc.add_OrchestratorAdminServicer_to_server(admin, server),
        ["tandem.v1.OrchestratorAdmin"],
        admin_listen,
        [BearerInterceptor(admin_token)] if admin_token is not None else [],
    )
    LOG.info("orchestrator admin on %s (%s)", admin_address, "token required" if admin_token else "no token")

    async def stop_admin() -> None:
        if http is not None:
            await http.stop()
        await admin_health.enter_graceful_shutdown()
        await admin_server.stop(grace=1.0)

    await run_server(
        "orchestrator",
        register,
        ["tandem.v1.Orchestrator"],
        listen,
        on_stop=stop_admin,
        background=background,
        interceptors=[BearerInterceptor(settings.api_key)] if settings.api_key is not None else [],
        unhealthy=lambda: service.generation.scheduler.unhealthy(time.monotonic()),
        drain=lambda: service.generation.drain(settings.shutdown_timeout_s),
    )
