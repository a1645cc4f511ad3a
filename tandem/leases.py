"""Which orchestrator owns which request, so that a service can drop the state of an orchestrator that is gone.

An orchestrator names itself with a session id (a uuid, new at every start) in the metadata of its calls. A request
is owned by the session that opened it. A session is alive while one of its streams is open, and for `timeout_s`
after its last stream closed or its last call ended; then every request it still owns is released. A restarted
orchestrator has a new session id, so the requests of the one before it expire even when the new one is busy.
Requests opened without a session id (a caller that does not say who it is) are never released this way.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from tandem.grpc_util import on_call_end, stream_calls, unary_call
from tandem.wire import common_pb2

SESSION_METADATA_KEY = "tandem-session"
Request = TypeVar("Request")
Response = TypeVar("Response")


def session_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The session id in a call's invocation metadata; "" when the caller sent none."""
    for key, value in metadata or ():
        if key == SESSION_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


def sweep_interval(timeout_s: float) -> float:
    """How often a service looks for expired sessions: a fraction of the timeout, within [0.1, 5] s."""
    return min(5.0, max(0.1, timeout_s / 4))


def session_metadata(session: str) -> tuple[tuple[str, str], ...]:
    return ((SESSION_METADATA_KEY, session),)


@dataclass
class _Session:
    open_streams: int = 0
    last_seen: float = 0.0
    requests: set[str] = field(default_factory=set)


class Leases:
    """Owners of requests and the liveness of sessions. Times are passed in (time.monotonic()), so that the rules
    are tested without waiting."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._sessions: dict[str, _Session] = {}
        self._owner: dict[str, str] = {}  # request id -> session

    def stream_opened(self, session: str, now: float) -> None:
        if session:
            entry = self._sessions.setdefault(session, _Session())
            entry.open_streams += 1
            entry.last_seen = now

    def stream_closed(self, session: str, now: float) -> None:
        entry = self._sessions.get(session) if session else None
        if entry is not None:
            entry.open_streams -= 1
            entry.last_seen = now

    def seen(self, session: str, now: float) -> None:
        """A call of the session (any call, streamed or not) keeps it alive."""
        if session:
            self._sessions.setdefault(session, _Session()).last_seen = now

    def own(self, session: str, request_id: str, now: float) -> None:
        """Records that `session` holds `request_id`; a request moves to the last session that touched it."""
        if not session:
            return
        previous = self._owner.get(request_id)
        if previous == session:
            return
        if previous is not None and previous in self._sessions:
            self._sessions[previous].requests.discard(request_id)
        entry = self._sessions.setdefault(session, _Session(last_seen=now))
        entry.requests.add(request_id)
        self._owner[request_id] = session

    def claim(self, session: str, request_id: str, now: float) -> bool:
        """Owns `request_id` for `session` unless a session owns it already; whether it did. Called before the work
        that makes a request's state, so that a call cut off mid-way (its caller died) leaves that state owned."""
        if not session or request_id in self._owner:
            return False
        self.own(session, request_id, now)
        return True

    def owner(self, request_id: str) -> str:
        """The session that owns `request_id`; "" for none."""
        return self._owner.get(request_id, "")

    def forget(self, request_ids: Sequence[str]) -> None:
        """Released requests: nobody owns them any more."""
        for request_id in request_ids:
            session = self._owner.pop(request_id, None)
            if session is not None and session in self._sessions:
                self._sessions[session].requests.discard(request_id)

    def expired(self, now: float) -> list[str]:
        """Requests of sessions that are gone; they and their sessions are forgotten here, the caller frees them."""
        gone = [
            session
            for session, entry in self._sessions.items()
            if entry.open_streams <= 0 and now - entry.last_seen > self.timeout_s
        ]
        released: list[str] = []
        for session in gone:
            entry = self._sessions.pop(session)
            released += sorted(entry.requests)
            for request_id in entry.requests:
                self._owner.pop(request_id, None)
        return released

    def owned(self) -> int:
        return len(self._owner)


async def leased_call(
    leases: Leases, context: grpc.aio.ServicerContext, handle: Callable[[str], Awaitable[Response]]
) -> Response:
    """A unary call of a session (tandem.grpc_util.unary_call): `handle` gets the caller's session id, and the call
    keeps the session alive."""
    session = session_of(context.invocation_metadata())
    try:
        return await unary_call(context, handle(session))
    finally:
        leases.seen(session, time.monotonic())


async def leased_stream(
    leases: Leases,
    context: grpc.aio.ServicerContext,
    requests: AsyncIterator[Request],
    handle: Callable[[Request, str], Awaitable[Response]],
    failed: Callable[[common_pb2.CallError], Response],
) -> AsyncIterator[Response]:
    """A stream of calls of a session (tandem.grpc_util.stream_calls): the session is alive until the call ends."""
    session = session_of(context.invocation_metadata())
    leases.stream_opened(session, time.monotonic())
    on_call_end(context, lambda: leases.stream_closed(session, time.monotonic()))
    async for response in stream_calls(requests, lambda request: handle(request, session), failed):
        yield response
