"""An idle stream between Tandem services survives the client's keepalive pings.

Tandem's clients ping every KEEPALIVE_S (tandem.grpc_util.channel_options), also on idle long-lived streams such as a
draft's SubscribeHidden, so that a peer that stops answering is noticed; a server that does not accept pings that
often answers the third with GOAWAY (too_many_pings), which once ended the draft's hidden-state stream after about 90
idle seconds. Here the stream is left idle past three of the client's pings."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.grpc_util import KEEPALIVE_S, add_standard_services, channel_options, create_server

IDLE_S = 3 * KEEPALIVE_S + 1.0  # past the third ping


def test_an_idle_stream_survives_keepalive_pings() -> None:
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
                # Nothing more comes while the status stays the same: the read is still pending after IDLE_S. A
                # GOAWAY (too_many_pings) would have ended it with UNAVAILABLE.
                pending = asyncio.ensure_future(watch.read())
                await asyncio.wait({pending}, timeout=IDLE_S)
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


def test_a_paused_server_is_noticed_within_two_keepalive_intervals() -> None:
    # A stopped process (SIGSTOP) still has its kernel acknowledge TCP: only the unanswered ping ends the stream.
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
                    await asyncio.wait_for(watch.read(), 2 * KEEPALIVE_S + 5)
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
                return time.monotonic() - paused

        assert asyncio.run(run()) <= 2 * KEEPALIVE_S + 3
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
