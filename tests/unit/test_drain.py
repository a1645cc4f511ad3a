"""Generation.drain (orchestrator/loop/generation.py): what a SIGTERM'd orchestrator does with its streams. The whole
path, through `tandem serve` and real signals, is tests/integration/test_drain.py's."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace
from typing import Any, cast

import pytest

from orchestrator.loop.generation import Generation
from orchestrator.loop.output import ShuttingDown
from orchestrator.peers.backends import FailureKind
from tandem.wire import orchestrator_pb2


def generation() -> Generation:
    scheduler = SimpleNamespace(waiting=deque(), running={})
    return Generation(cast(Any, scheduler), cast(Any, None), cast(Any, None))


class Stream:
    """A stream in flight, as stream() holds it: its request's messages are what the client reads."""

    def __init__(self) -> None:
        self.request_id = "r1"
        self.output = SimpleNamespace(messages=asyncio.Queue())


def stream(generation: Generation) -> Stream:
    active = Stream()
    generation._streams[active.request_id] = cast(Any, active)
    generation._idle.clear()
    return active


def test_a_drain_refuses_new_requests_and_waits_for_the_streams_in_flight() -> None:
    async def scenario() -> tuple[int, float]:
        running = generation()
        active = stream(running)
        draining = asyncio.create_task(running.drain(timeout_s=30.0))
        await asyncio.sleep(0.05)
        with pytest.raises(ShuttingDown) as refused:
            await anext(running.stream(orchestrator_pb2.GenerateRequest(input_ids=[1, 2]), "client"))
        assert refused.value.kind is FailureKind.UNAVAILABLE and "takes no new requests" in str(refused.value)
        assert not draining.done()  # the stream is still running
        running._streams.pop(active.request_id)  # it ends, as stream()'s finally does
        running._idle.set()
        started = asyncio.get_running_loop().time()
        ended = await draining
        assert active.output.messages.empty()  # it ended by itself: nothing was put in its way
        return ended, asyncio.get_running_loop().time() - started

    ended, seconds = asyncio.run(scenario())
    assert ended == 0 and seconds < 1.0


def test_streams_still_running_at_the_timeout_end_with_unavailable_naming_it() -> None:
    async def scenario() -> tuple[int, object]:
        running = generation()
        active = stream(running)
        ended = await running.drain(timeout_s=0.1)
        return ended, active.output.messages.get_nowait()

    ended, message = asyncio.run(scenario())
    assert ended == 1
    assert isinstance(message, ShuttingDown) and message.kind is FailureKind.UNAVAILABLE
    assert "shut down before this request ended (--shutdown-timeout 0.1 s)" in str(message)
