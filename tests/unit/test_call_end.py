"""The cleanup of a streaming call runs when the call ends, not when its generator is collected.

gRPC's asyncio server stops iterating a handler's generator without closing it when a response cannot be written
because the peer went away while the write waited; a `finally` in that generator then runs only when the generator
is collected. These tests hold a reference to the generators (as a reference cycle would) and cancel the call while
the server waits to write (the client reads nothing, so HTTP/2 flow control stops the writes): what tandem.leases
and tandem.grpc_util.closed_at_call_end clean up must be clean all the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from tandem.grpc_util import closed_at_call_end
from tandem.leases import Leases, leased_stream, session_metadata

RESPONSE = b"x" * (1 << 20)  # 1 MiB: a few fill the stream's flow-control window


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)


async def serve_and_cancel(
    handler: Callable[[AsyncIterator[bytes], grpc.aio.ServicerContext], AsyncIterator[bytes]],
    made: Callable[[], int],
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Serves `handler` as a stream-stream method, calls it with one request, reads one response and then nothing
    until the server is stuck writing (the responses it made, `made()`, stop growing), and cancels the call."""
    made_before = -1

    def stalled() -> bool:
        nonlocal made_before
        still, made_before = made() == made_before, made()
        return still and made_before > 2

    server = grpc.aio.server()
    method = grpc.stream_stream_rpc_method_handler(handler)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Calls", {"Stream": method}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = [("grpc.max_receive_message_length", 4 * len(RESPONSE))]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.stream_stream("/test.Calls/Stream")(metadata=metadata)
            await call.write(b"go")
            await call.read()
            await until(stalled, "the server waits to write")
            call.cancel()
    finally:
        await server.stop(None)


def test_a_leased_stream_ends_its_session_when_the_call_ends_while_a_write_waits() -> None:
    leases = Leases(timeout_s=1.0)
    held: list[AsyncIterator[bytes]] = []  # keeps the generators from being collected
    answered = 0

    async def answer(request: bytes, session: str) -> bytes:
        nonlocal answered
        answered += 1
        return RESPONSE

    async def forever(requests: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for request in requests:
            while True:
                yield request

    async def handler(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        responses = leased_stream(leases, context, forever(requests), answer, lambda error: b"")
        held.append(responses)
        async for response in responses:
            yield response

    async def scenario() -> None:
        await serve_and_cancel(handler, lambda: answered, session_metadata("orchestrator"))
        # The session's only stream ended: its requests expire after the timeout, with no garbage collection.
        await until(lambda: leases._sessions["orchestrator"].open_streams == 0, "the session's stream closed")
        assert held

    asyncio.run(scenario())


def test_a_generator_closed_at_call_end_runs_its_finally_when_the_call_ends_while_a_write_waits() -> None:
    held: list[AsyncGenerator[bytes, None]] = []
    yielded = 0
    closed = False

    async def outputs() -> AsyncGenerator[bytes, None]:
        nonlocal yielded, closed
        try:
            while True:
                yielded += 1
                yield RESPONSE
        finally:
            closed = True

    async def handler(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        generator = closed_at_call_end(context, outputs())
        held.append(generator)
        async for output in generator:
            yield output

    async def scenario() -> None:
        await serve_and_cancel(handler, lambda: yielded)
        await until(lambda: closed, "the generator's finally ran")

    asyncio.run(scenario())
