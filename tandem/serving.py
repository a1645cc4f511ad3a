"""Runs one Tandem gRPC server process: bind, health + reflection, ready file, clean stop on signals."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.grpc_util import add_standard_services, create_server

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListenSettings:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound address goes to ready_file
    ready_file: Path | None = None  # written (atomically) with "host:port" once the server serves


async def run_server(
    name: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    listen: ListenSettings,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    background: Sequence[asyncio.Task[None]] = (),
) -> None:
    """Serves until SIGINT, SIGTERM or cancellation, then reports NOT_SERVING, runs on_stop and stops the server.

    `background` tasks are essential to the service (a scheduler loop, a hidden-state stream): when one
    ends, the process stops instead of serving in a broken state.
    """
    server = create_server()
    register(server)
    health = await add_standard_services(server, service_names)
    port = server.add_insecure_port(f"{listen.host}:{listen.port}")
    await server.start()
    address = f"{listen.host}:{port}"
    if listen.ready_file is not None:
        partial = listen.ready_file.with_suffix(".partial")
        partial.write_text(address)
        os.replace(partial, listen.ready_file)
    LOG.info("%s serving on %s", name, address)
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
    await health.enter_graceful_shutdown()
    if on_stop is not None:
        await on_stop()
    await server.stop(grace=1.0)
    for task in background:
        task.cancel()
    if failed:
        raise SystemExit(1)
    if cancelled:
        raise asyncio.CancelledError


def configure_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
