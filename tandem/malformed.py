"""Malformed request messages get INVALID_ARGUMENT, on every server (a server interceptor).

gRPC itself answers a request it cannot parse with a generic error that does not say what was wrong. The
interceptor wraps each method's deserializer so that a message that does not parse becomes a `Malformed` value,
and the method's behaviour answers it with INVALID_ARGUMENT naming the method, before any service code runs.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Malformed:
    """A request message that did not parse."""

    reason: str


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that swaps the handler of every method the server has (`replace`); a method it does not
    have (no handler) goes on to gRPC's own UNIMPLEMENTED answer. Also the base of tandem.auth.BearerInterceptor."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.replace(handler, handler_call_details)

    @abstractmethod
    def replace(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """The handler the call runs: `handler` itself, or one of the same kind that wraps or refuses it."""


class MalformedRequests(HandlerInterceptor):
    def replace(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler
        method = details.method
        parse = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except (DecodeError, ValueError, TypeError) as error:
                return Malformed(f"{method}: the request message does not parse ({error})")

        wrapped: dict[str, Any] = {"request_deserializer": deserialize}
        if handler.unary_unary is not None:
            wrapped["unary_unary"] = _unary_unary(handler.unary_unary)
        elif handler.unary_stream is not None:
            wrapped["unary_stream"] = _unary_stream(handler.unary_stream)
        elif handler.stream_unary is not None:
            wrapped["stream_unary"] = _stream_unary(handler.stream_unary)
        elif handler.stream_stream is not None:
            wrapped["stream_stream"] = _stream_stream(handler.stream_stream)
        return handler._replace(**wrapped)


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        await _refuse(request, context)
        yield request


async def _respond(result: Any) -> AsyncIterator[Any]:
    """A streaming behaviour's responses, whether it yields them or writes them with context.write."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


def _unary_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _refuse(request, context)
        return await behaviour(request, context)

    return run


def _unary_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _refuse(request, context)
        async for response in _respond(behaviour(request, context)):
            yield response

    return run


def _stream_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def run(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(_checked(requests, context), context)

    return run


def _stream_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def run(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in _respond(behaviour(_checked(requests, context), context)):
            yield response

    return run
