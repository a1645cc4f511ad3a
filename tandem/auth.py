"""Bearer-token authentication: the public API key and the admin token.

A client sends `authorization: Bearer <key>` (gRPC metadata, or the HTTP header of the same name). `check_bearer`
is the one check, shared by the gRPC interceptor here and any HTTP front end: it compares in constant time
(hmac.compare_digest) and its messages never contain the key that was sent or expected.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from tandem.malformed import HandlerInterceptor

API_KEY_VARIABLE = "TANDEM_API_KEY"  # the environment variables the commands read the secrets from
ADMIN_TOKEN_VARIABLE = "TANDEM_ADMIN_TOKEN"
AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
SCHEME = "Bearer"
# Services a bearer-protected server still answers without a token: probes (Kubernetes, load balancers) check
# health, and reflection only describes the services, whose definitions are public.
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME})


class Unauthenticated(Exception):
    """A request without the right bearer token; the message says what was wrong, without any key."""


def check_bearer(header_value: str | None, key: str) -> None:
    """Accepts `header_value` when it is `Bearer <key>`; raises Unauthenticated saying what is wrong otherwise."""
    if header_value is None or not header_value.strip():
        raise Unauthenticated(f"missing credentials: send the metadata '{AUTHORIZATION}: {SCHEME} <key>'")
    scheme, _, given = header_value.strip().partition(" ")
    if scheme.lower() != SCHEME.lower() or not given.strip():
        raise Unauthenticated(f"{AUTHORIZATION}: expected '{SCHEME} <key>'")
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise Unauthenticated(f"{AUTHORIZATION}: the key is not valid")


def bearer_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends with `key` (none without a key)."""
    return () if key is None else ((AUTHORIZATION, f"{SCHEME} {key}"),)


def service_of(method: str) -> str:
    """`/tandem.v1.Orchestrator/Generate` -> `tandem.v1.Orchestrator`."""
    return method.lstrip("/").partition("/")[0]


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with UNAUTHENTICATED and `message`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a server-streaming handler must be; never reached

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)


class BearerInterceptor(HandlerInterceptor):
    """Lets a call through only with `authorization: Bearer <key>`, except calls to `open_services`."""

    def __init__(self, key: str, open_services: Collection[str] = OPEN_SERVICES) -> None:
        if not key:
            raise ValueError("an empty key would let every client in")
        self._key = key
        self._open_services = frozenset(open_services)

    def __repr__(self) -> str:
        return f"BearerInterceptor(open_services={sorted(self._open_services)})"  # never the key

    def replace(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if service_of(details.method) in self._open_services:
            return handler
        values = [value for name, value in details.invocation_metadata or () if name == AUTHORIZATION]
        try:
            check_bearer(values[0] if values else None, self._key)
        except Unauthenticated as refused:
            return _refusal(handler, str(refused))
        return handler


def resolve_secret(value: str | None, file: Path | None, environment_variable: str, flag: str) -> str | None:
    """A secret from its flag, its file flag, or the environment, in that order; None when none is set.

    A flag and a file together are refused, and so is an empty secret: both are mistakes, not a wish for no key.
    """
    if value is not None and file is not None:
        raise ValueError(f"{flag} and {flag}-file: give one of them")
    if file is not None:
        try:
            value = file.read_text().strip()
        except OSError as error:
            raise ValueError(f"{flag}-file {file}: cannot be read ({error.strerror})") from error
        if not value:
            raise ValueError(f"{flag}-file {file}: the file is empty")
        return value
    if value is None:
        value = os.environ.get(environment_variable)
        flag = environment_variable
    if value is not None and not value.strip():
        raise ValueError(f"{flag}: empty; leave it unset for no key")
    return None if value is None else value.strip()
