"""Runs one Tandem gRPC server process: bind, health + reflection, ready file, clean stop on signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from tandem.errors import StartupError
from tandem.grpc_util import MAX_MESSAGE_BYTES, add_standard_services, channel_options, create_server
from tandem.settings import log_level
from tandem.transport import Insecure, TransportSecurity

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound address goes to ready_file
    ready_file: Path | None = None  # written (atomically) with "host:port" once the server serves
    security: TransportSecurity = field(default_factory=Insecure)  # how the port is bound (tandem.transport)
    # Largest request message the server takes (larger ones get RESOURCE_EXHAUSTED before any parsing). Internal
    # services carry hidden states and weights; the public port is capped far lower (--max-request-bytes).
    max_message_bytes: int = MAX_MESSAGE_BYTES


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    listen: ListenSettings,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, str]:
    """Builds, binds (with listen.security) and starts a server; writes its address to listen.ready_file.

    Returns the server, its health servicer (for `enter_graceful_shutdown`) and the bound "host:port".
    """
    limit = "grpc.max_receive_message_length"
    options = [*(option for option in channel_options() if option[0] != limit), (limit, listen.max_message_bytes)]
    server = create_server(options, interceptors)
    register(server)
    health_servicer = await add_standard_services(server, service_names)
    port = listen.security.add_port(server, f"{listen.host}:{listen.port}")
    await server.start()
    address = f"{listen.host}:{port}"
    if listen.ready_file is not None:
        partial = listen.ready_file.with_suffix(".partial")
        partial.write_text(address)
        os.replace(partial, listen.ready_file)
    return server, health_servicer, address


async def run_server(
    name: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    listen: ListenSettings,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    background: Sequence[asyncio.Task[None]] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    unhealthy: Callable[[], str | None] | None = None,
    drain: Callable[[], Awaitable[object]] | None = None,
) -> None:
    """Serves until SIGINT, SIGTERM or cancellation, then reports NOT_SERVING, drains, runs on_stop and stops the
    server.

    `background` tasks are essential to the service (a scheduler loop, a hidden-state stream): when one
    ends, the process stops instead of serving in a broken state. `unhealthy`, polled every HEALTH_POLL_S, says
    why the service cannot serve now (None when it can); grpc.health.v1 reports NOT_SERVING meanwhile. `drain` lets
    the calls in flight finish before the server stops (not when a background task ended: nothing would progress).
    """
    server, health_servicer, address = await start_server(register, service_names, listen, interceptors)
    LOG.info("%s serving on %s (%s)", name, address, listen.security.describe())
    if unhealthy is not None:
        watch = asyncio.create_task(report_health(name, health_servicer, service_names, unhealthy), name="health")
        background = [*background, watch]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Signals reach only the main thread. A server run on a loop in another thread (a Ray actor's) is
    # stopped by cancelling its task, which ends in the same graceful shutdown below.
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
    failed: list[str] = []

    def on_background_done(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            error = task.exception()
            failed.append(f"{task.get_name()} ended: {error!r}" if error else f"{task.get_name()} ended")
        stop.set()

    for task in background:
        task.add_done_callback(on_background_done)
    cancelled = False
    try:
        await stop.wait()
    except asyncio.CancelledError:
        cancelled = True
    for reason in failed:
        LOG.error("%s: %s, stopping", name, reason)
    LOG.info("%s stopping", name)
    await health_servicer.enter_graceful_shutdown()
    for step in (drain if not failed else None, on_stop):
        if step is not None:
            await step()
    await server.stop(grace=1.0)
    for task in background:
        task.cancel()
    if failed:
        raise SystemExit(1)
    if cancelled:
        raise asyncio.CancelledError


HEALTH_POLL_S = 1.0


async def report_health(
    name: str,
    health_servicer: health.aio.HealthServicer,
    service_names: Sequence[str],
    unhealthy: Callable[[], str | None],
) -> None:
    """Sets the server's health (the whole server and each service) from `unhealthy`, logging each change."""
    reported: str | None = None
    while True:
        reason = unhealthy()
        if reason != reported:
            status = health_pb2.HealthCheckResponse.NOT_SERVING if reason else health_pb2.HealthCheckResponse.SERVING
            for service in ("", *service_names):
                await health_servicer.set(service, status)
            if reason:
                LOG.error("%s: NOT_SERVING: %s", name, reason)
            else:
                LOG.info("%s: SERVING again", name)
            reported = reason
        await asyncio.sleep(HEALTH_POLL_S)


def configure_logging(name: str) -> None:
    """Logs to stderr at TANDEM_LOG_LEVEL (INFO unless set); raises StartupError naming a level that is none."""
    try:
        level = log_level()
    except ValueError as error:
        raise StartupError(str(error)) from None
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
