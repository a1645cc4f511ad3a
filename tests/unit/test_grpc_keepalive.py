"""An idle stream between Tandem services survives the client's keepalive pings.

Tandem's clients ping every half keepalive timeout (tandem.grpc_util.channel_options, --keepalive-timeout), also on
idle long-lived streams such as a draft's SubscribeHidden, so that a peer that stops answering is noticed; a server
that does not accept pings that often answers the third with GOAWAY (too_many_pings), which once ended the draft's
hidden-state stream after about 90 idle seconds. Here the stream is left idle past three pings of a client with the
shortest timeout, and a paused server is noticed within the default timeout and within a shorter one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem import grpc_util
from tandem.grpc_util import KEEPALIVE_TIMEOUT_S, add_standard_services, channel_options, create_server

SHORTEST_S = 1.0  # the shortest --keepalive-timeout: a ping every 0.4 s


@pytest.fixture
def keepalive_timeout() -> Iterator[None]:
    yield
    grpc_util.set_keepalive_timeout(KEEPALIVE_TIMEOUT_S)


def test_an_idle_stream_survives_keepalive_pings(keepalive_timeout: None) -> None:
    grpc_util.set_keepalive_timeout(SHORTEST_S)
    idle_s = 3 * 0.4 * SHORTEST_S + 1.0  # past the third ping

    async def run() -> None:
        server = create_server()
        await add_standard_services(server, [])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                # Nothing more comes while the status stays the same: the read is still pending after idle_s. A
                # GOAWAY (too_many_pings) would have ended it with UNAVAILABLE.
                pending = asyncio.ensure_future(watch.read())
                await asyncio.wait({pending}, timeout=idle_s)
                assert not pending.done(), pending.exception() or pending.result()
                assert not watch.done()
                watch.cancel()
        finally:
            await server.stop(None)

    asyncio.run(run())


SERVER = """
import asyncio, sys
from tandem.grpc_util import add_standard_services, create_server

async def main():
    server = create_server()
    await add_standard_services(server, [])
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


@pytest.mark.parametrize("timeout_s", [KEEPALIVE_TIMEOUT_S, 2.0])
def test_a_paused_server_is_noticed_within_the_keepalive_timeout(keepalive_timeout: None, timeout_s: float) -> None:
    # A stopped process (SIGSTOP) still has its kernel acknowledge TCP: only the unanswered ping ends the stream.
    grpc_util.set_keepalive_timeout(timeout_s)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())

        async def run() -> float:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                os.kill(server.pid, signal.SIGSTOP)
                paused = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await asyncio.wait_for(watch.read(), timeout_s + 5)
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                return time.monotonic() - paused

        assert asyncio.run(run()) <= 0.9 * timeout_s + 0.5  # a ping after 0.4 of it, its ack awaited 0.5
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
