"""A Generate stream that outlives its orchestrator: the client side of GenerateRequest.resume_token_ids.

When the stream breaks (the orchestrator was killed, restarted or is draining: UNAVAILABLE, or the connection went
away mid-stream) the client sends the same request again, to the same address or the next of several, with the tokens
it has received so far as resume_token_ids; the orchestrator that takes it continues after them, and for a greedy or
seeded request the tokens are those the unbroken stream would have sent. The caller sees one stream. Attempts back
off exponentially and are bounded: after `attempts` failures in a row with no token received between them, the last
error is raised. Any gRPC client can do the same; docs/serving.md gives the protocol.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc

# A stream cut by its server's end: the process went away (UNAVAILABLE, or a reset stream reported as INTERNAL or
# UNKNOWN), or it is shutting down and takes no new requests (UNAVAILABLE).
RESUMED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


@dataclass(frozen=True)
class Reconnects:
    attempts: int = 8  # failures in a row (no token between them) before giving up; 0: never resume
    first_backoff_s: float = 0.2
    max_backoff_s: float = 4.0

    def backoff_s(self, failures: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** (failures - 1))


class StreamBroken(Exception):
    """A stream that ended without a finish_reason (its server went away between two messages)."""


def resuming_stream(
    addresses: Sequence[str],
    request: orchestrator_pb2.GenerateRequest,
    open_channel: Callable[[str], grpc.Channel],
    *,
    metadata: Sequence[tuple[str, str]] = (),
    timeout_s: float = 3600.0,
    reconnects: Reconnects = Reconnects(),
    on_reconnect: Callable[[str, str, int], None] = lambda address, cause, tokens: None,
) -> Iterator[orchestrator_pb2.GenerateResponse]:
    """The responses of one Generate request as if its stream never broke; each response's token_ids are new.

    `open_channel(address)` makes a channel (plain or TLS); `on_reconnect(address, cause, tokens)` is told of each
    reconnection: where to, why, and how many tokens the resumed request carries. The last response has the
    finish_reason; its stats count the resumed tokens in completion_tokens (rounds and drafts are the last
    orchestrator's). Raises the last grpc.RpcError (or StreamBroken) once `reconnects.attempts` in a row failed."""
    received = list(request.resume_token_ids)
    failures, index = 0, 0
    while True:
        address = addresses[index % len(addresses)]
        attempt = orchestrator_pb2.GenerateRequest()
        attempt.CopyFrom(request)
        attempt.resume_token_ids[:] = received
        try:
            with open_channel(address) as channel:
                stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
                for response in stub.Generate(attempt, timeout=timeout_s, metadata=tuple(metadata)):
                    if response.token_ids:
                        received.extend(response.token_ids)
                        failures = 0
                    yield response
                    if response.finish_reason:
                        return
            raise StreamBroken(f"the stream from {address} ended without a finish_reason")
        except (grpc.RpcError, StreamBroken) as error:
            cause = _broken_by(error)
            if cause is None or failures >= reconnects.attempts:
                raise
            failures += 1
            index += 1
            on_reconnect(addresses[index % len(addresses)], cause, len(received))
            time.sleep(reconnects.backoff_s(failures))


def _broken_by(error: grpc.RpcError | StreamBroken) -> str | None:
    """What broke a stream, when a resume may mend it; None for an answer to the request itself (INVALID_ARGUMENT)."""
    if isinstance(error, StreamBroken):
        return str(error)
    code = error.code()
    return f"{code.name}: {error.details()}" if code in RESUMED_CODES else None
