"""The server interceptors every Tandem server may carry, in-process over a real gRPC server, in the order
tandem.grpc_util.create_server installs them: MalformedRequests (tandem.malformed) first, then BearerInterceptor
(tandem.auth).

The server has health (an open service) and one unary and one server-streaming echo method whose request parser
refuses the bytes b"bad", as a protobuf message that does not parse would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.auth import BearerInterceptor, bearer_metadata
from tandem.grpc_util import add_standard_services, create_server

KEY = "secret-key"
SERVICE = "test.Echo"


def parse(data: bytes) -> str:
    if data == b"bad":
        raise ValueError("not a message")
    return data.decode()


async def echo(request: str, context: grpc.aio.ServicerContext) -> bytes:
    return request.encode()


async def echo_twice(request: str, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    for _ in range(2):
        yield request.encode()


ECHO_HANDLERS = grpc.method_handlers_generic_handler(
    SERVICE,
    {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parse),
        "EchoTwice": grpc.unary_stream_rpc_method_handler(echo_twice, request_deserializer=parse),
    },
)


def with_server(check: Callable[[grpc.aio.Channel], Awaitable[None]]) -> None:
    async def run() -> None:
        server = create_server(interceptors=[BearerInterceptor(KEY)])
        server.add_generic_rpc_handlers((ECHO_HANDLERS,))
        await add_standard_services(server, [SERVICE])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check(channel)
        finally:
            await server.stop(None)

    asyncio.run(run())


async def call_echo(channel: grpc.aio.Channel, request: bytes, key: str | None) -> bytes:
    call = channel.unary_unary(f"/{SERVICE}/Echo")
    response: bytes = await call(request, metadata=bearer_metadata(key))
    return response


async def call_echo_twice(channel: grpc.aio.Channel, request: bytes, key: str | None) -> list[Any]:
    call = channel.unary_stream(f"/{SERVICE}/EchoTwice")
    return [response async for response in call(request, metadata=bearer_metadata(key))]


async def status_of(call: Awaitable[Any]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    code: grpc.StatusCode = refused.value.code()
    return code


def test_a_call_with_the_key_and_a_message_that_parses_runs() -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        assert await call_echo(channel, b"hello", KEY) == b"hello"
        assert await call_echo_twice(channel, b"hi", KEY) == [b"hi", b"hi"]

    with_server(check)


def test_a_call_without_the_right_key_is_unauthenticated() -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        assert await status_of(call_echo(channel, b"hello", None)) == grpc.StatusCode.UNAUTHENTICATED
        assert await status_of(call_echo(channel, b"hello", "wrong")) == grpc.StatusCode.UNAUTHENTICATED
        assert await status_of(call_echo_twice(channel, b"hi", None)) == grpc.StatusCode.UNAUTHENTICATED

    with_server(check)


def test_a_message_that_does_not_parse_is_an_invalid_argument() -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        assert await status_of(call_echo(channel, b"bad", KEY)) == grpc.StatusCode.INVALID_ARGUMENT
        assert await status_of(call_echo_twice(channel, b"bad", KEY)) == grpc.StatusCode.INVALID_ARGUMENT

    with_server(check)


def test_open_services_need_no_key_and_unknown_methods_stay_unimplemented() -> None:
    async def check(channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        unknown = channel.unary_unary(f"/{SERVICE}/Missing")(b"hello", metadata=bearer_metadata(KEY))
        assert await status_of(unknown) == grpc.StatusCode.UNIMPLEMENTED

    with_server(check)
