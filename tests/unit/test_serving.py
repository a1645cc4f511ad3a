"""run_server on a loop outside the main thread (as in a Ray actor): cancelling it is a graceful stop."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving import ListenSettings, run_server

SERVICE = "tandem.v1.Test"


def test_cancelled_server_in_a_thread_stops_gracefully(tmp_path: Path) -> None:
    ready_file = tmp_path / "address"
    served: list[int] = []  # health status seen by on_stop: NOT_SERVING once the shutdown has begun
    state: dict[str, object] = {}

    async def on_stop() -> None:
        async with grpc.aio.insecure_channel(ready_file.read_text()) as channel:
            request = health_pb2.HealthCheckRequest(service=SERVICE)
            response = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            served.append(response.status)

    async def serve() -> None:
        state["loop"] = asyncio.get_running_loop()
        state["task"] = asyncio.current_task()
        await run_server("test", lambda server: None, [SERVICE], ListenSettings(ready_file=ready_file), on_stop)

    def run() -> None:
        try:
            asyncio.run(serve())
        except asyncio.CancelledError:
            state["cancelled"] = True

    thread = threading.Thread(target=run)
    thread.start()  # not the main thread: run_server must not try to install signal handlers
    while not ready_file.exists():
        assert thread.is_alive(), "run_server ended before serving"
        thread.join(timeout=0.05)
    host, port = ready_file.read_text().rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()

    loop, task = state["loop"], state["task"]
    assert isinstance(loop, asyncio.AbstractEventLoop) and isinstance(task, asyncio.Task)
    loop.call_soon_threadsafe(task.cancel)
    thread.join(timeout=10)

    assert not thread.is_alive()
    assert state.get("cancelled") is True  # the cancellation still reaches the caller after the shutdown
    assert served == [health_pb2.HealthCheckResponse.NOT_SERVING]
    with pytest.raises(OSError):  # the server stopped listening
        socket.create_connection((host, int(port)), timeout=1).close()
