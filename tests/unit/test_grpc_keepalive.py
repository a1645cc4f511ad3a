"""An idle stream between Tandem services survives the client's keepalive pings.

Tandem's clients ping every 30 s (tandem.grpc_util.channel_options) so that idle long-lived streams such as a draft's
SubscribeHidden stay open; a server that does not accept pings that often answers the third with GOAWAY
(too_many_pings), which ended the draft's hidden-state stream after about 90 idle seconds. Here the client pings every
10 s, the shortest interval the servers accept, and the stream is left idle past three pings."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.grpc_util import add_standard_services, channel_options, create_server

IDLE_S = 35.0  # past the third ping at 10 s intervals


def test_an_idle_stream_survives_keepalive_pings() -> None:
    async def run() -> None:
        server = create_server()
        await add_standard_services(server, [])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        options = [(key, value) for key, value in channel_options() if key != "grpc.keepalive_time_ms"]
        options.append(("grpc.keepalive_time_ms", 10_000))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
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
