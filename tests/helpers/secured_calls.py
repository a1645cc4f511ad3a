"""The status code a call gets through a channel of a given TransportSecurity (OK when it was answered): how the
security tests tell a refused handshake (UNAVAILABLE) from a served call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.transport import TransportSecurity


def call_code(security: TransportSecurity, address: str, call: Callable[[grpc.Channel], object]) -> grpc.StatusCode:
    with security.channel(address) as channel:
        try:
            call(channel)
        except grpc.RpcError as error:
            failed: Any = error  # a grpc.Call as well
            return failed.code()
    return grpc.StatusCode.OK


def health_code(security: TransportSecurity, address: str) -> grpc.StatusCode:
    """The status of a grpc.health.v1 Check through `security`."""
    return call_code(
        security,
        address,
        lambda channel: health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5),
    )
