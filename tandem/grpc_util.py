"""gRPC plumbing shared by every Tandem service: channel options, server creation, health and reflection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.background import in_background
from tandem.malformed import MalformedRequests
from tandem.wire import common_pb2

T = TypeVar("T")
Request = TypeVar("Request")

# Hidden-state batches and verify responses of large batches exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# Answers of a health check that mean "not up yet" rather than "wrong or broken peer".
_NOT_READY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)

# Pause between health checks while waiting for a server that answers but is not SERVING yet.
HEALTH_POLL_INTERVAL_S = 0.05


# How long a peer may stay silent (no answer to keepalive pings) before its connection is dropped, by default
# (--keepalive-timeout); a ping goes after 0.4 of it without a frame, and its ack may take 0.5: 0.9 of it in all.
KEEPALIVE_TIMEOUT_S = 10.0
_keepalive_timeout_s = KEEPALIVE_TIMEOUT_S
KEEPALIVE_HELP = "seconds a peer may stay silent (keepalive pings unanswered) before its connection is dropped"


def set_keepalive_timeout(seconds: float) -> None:
    """Sets this process's keepalive timeout for every channel and server made after it (a service's flag)."""
    global _keepalive_timeout_s
    if seconds < 1.0:
        raise ValueError(f"--keepalive-timeout must be at least 1 s, got {seconds}")
    _keepalive_timeout_s = seconds


def channel_options() -> list[tuple[str, int]]:
    """Options for both channels and servers; each side ignores the keys meant for the other.

    The services talk over loopback or a cluster network through long-lived streams (SubscribeHidden) that can
    sit idle between requests, so clients ping to keep them open and servers must accept those pings.
    """
    ping_ms, ack_ms = int(_keepalive_timeout_s * 400), int(_keepalive_timeout_s * 500)
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        # Client: ping after ping_ms without a frame, also with no call in flight, and drop the connection when its ack
        # takes ack_ms: a peer that stopped answering (paused, blackholed, its host gone) is noticed within the timeout,
        # where a reader on a half-open connection would otherwise wait for its deadline (--target-timeout: 300 s).
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", ack_ms),
        ("grpc.http2.ping_timeout_ms", ack_ms),  # what the C-core waits for an ack (default 1 min)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Server: by default it answers pings more often than every 5 min with GOAWAY (too_many_pings); it takes
        # them a little more often than a client with the shortest timeout (1 s: every 400 ms) sends them, whatever
        # its own timeout.
        # (The C-core constant is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; its string has no "recv".)
        ("grpc.http2.min_ping_interval_without_data_ms", 300),
        # A restarted peer comes back within seconds; gRPC's default backoff would wait up to 2 min to retry.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Peers are addressed directly; an http_proxy variable in the environment must not reroute them.
        ("grpc.enable_http_proxy", 0),
    ]


def create_server(
    options: Sequence[tuple[str, int]] | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
) -> grpc.aio.Server:
    """A grpc.aio server with `options`, channel_options() when None. Add ports and services, then start it.

    Every server answers a request message that does not parse with INVALID_ARGUMENT (tandem.malformed), before
    the other `interceptors` run.
    """
    return grpc.aio.server(
        options=channel_options() if options is None else list(options),
        interceptors=[MalformedRequests(), *interceptors],
    )


# A health check name every server reports SERVING until it shuts down, whatever its peers do: a liveness probe asks
# for it, so that an orchestrator that waits for its target (NOT_SERVING for "") is taken out of rotation by its
# readiness probe, not restarted, and an event loop that answers nothing fails it.
LIVENESS = "tandem.v1.Liveness"


async def add_standard_services(
    server: grpc.aio.Server, service_full_names: Sequence[str]
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 and server reflection on a server; call before server.start().

    Health reports SERVING for "" (the whole server), for each named service and for LIVENESS. Reflection lists the
    named services and the health and reflection services themselves. The health servicer is returned so that the
    caller can report NOT_SERVING when it shuts down (`enter_graceful_shutdown`). This is a coroutine because
    the asyncio health servicer's `set` is one.
    """
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_full_names, LIVENESS):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer


async def wait_for_ready(
    address: str, timeout_s: float, open_channel: Callable[[str], grpc.aio.Channel], service: str = ""
) -> None:
    """Polls grpc.health.v1 Check at `address` until `service` ("" for the whole server) reports SERVING.

    `open_channel` is the caller's transport security's (`security.aio_channel`), so that the check goes the way
    the caller's calls will.

    Raises TimeoutError naming the address and the last answer when that does not happen within timeout_s.
    Errors other than "not reachable yet" (UNAVAILABLE), "service not registered yet" (NOT_FOUND) and the
    deadline propagate at once: they mean the peer is not a Tandem service or is broken.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last_answer = "no answer"
    request = health_pb2.HealthCheckRequest(service=service)
    async with open_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := deadline - loop.time()) > 0:
            try:
                # wait_for_ready: a call made before the server listens waits for the connection instead of failing.
                response = await stub.Check(request, timeout=remaining, wait_for_ready=True)
            except grpc.aio.AioRpcError as error:
                if error.code() not in _NOT_READY_CODES:
                    raise
                last_answer = f"{error.code().name}: {error.details()}"
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_answer = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            await asyncio.sleep(min(HEALTH_POLL_INTERVAL_S, max(0.0, deadline - loop.time())))
    raise TimeoutError(
        f"gRPC server at {address} did not report {service or 'the whole server'} SERVING "
        f"within {timeout_s} s; last answer: {last_answer}"
    )


class CallFailed(Exception):
    """The failure of one call: the gRPC status it ends with and a message saying what is wrong.

    A unary handler aborts with it; a handler of calls on a long-lived stream answers with `as_proto()` in the
    response's `error` field instead, so that the stream serves the next call.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    def as_proto(self) -> common_pb2.CallError:
        return common_pb2.CallError(code=self.code.value[0], message=str(self))

    @classmethod
    def from_proto(cls, error: common_pb2.CallError) -> CallFailed:
        return cls(STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message)


STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a CallError's number -> grpc.StatusCode


async def unary_call(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """A unary handler's work: a CallFailed ends the call with its status and message."""
    try:
        return await work
    except CallFailed as failure:
        await context.abort(failure.code, str(failure))
        raise AssertionError("unreachable") from None


async def stream_calls(
    requests: AsyncIterator[Request],
    handle: Callable[[Request], Awaitable[T]],
    failed: Callable[[common_pb2.CallError], T],
) -> AsyncIterator[T]:
    """Answers a stream's requests one by one, in order; a CallFailed becomes a response with `error` set."""
    async for request in requests:
        try:
            yield await handle(request)
        except CallFailed as failure:
            yield failed(failure.as_proto())


def on_call_end(context: grpc.aio.ServicerContext, callback: Callable[[], object]) -> None:
    """Runs `callback` on the event loop once the call has ended, however it ended: answered, failed, cancelled, or
    its peer gone.

    The cleanup of a streaming handler goes here, not in a `finally` of its generator: gRPC's asyncio server stops
    iterating a handler's generator without closing it when a response cannot be written (the peer went away while
    the write waited), and a `finally` then runs only when the generator is collected, which a reference cycle can
    put off until the garbage collector runs (grpc/grpc#42295)."""
    context.add_done_callback(lambda _: callback())


def closed_at_call_end(
    context: grpc.aio.ServicerContext, generator: AsyncGenerator[T, None]
) -> AsyncGenerator[T, None]:
    """`generator`, which a streaming handler iterates, closed as soon as the call ends (on_call_end), so that its
    `finally` blocks run then. A generator that already ended is left as it is."""

    on_call_end(context, lambda: in_background(generator.aclose()))
    return generator
