"""The fault tests' checks on streams in flight through a fault (bench.fault_streams): each ended as a run without
the fault and without speculation would have (no token repeated, missing or changed), with nothing left held on the
target or the replicas.
"""

from __future__ import annotations

from collections.abc import Callable

from bench import fault_streams
from bench.fault_streams import NEW_TOKENS, PROMPTS, STREAMS, Stream, held_after, target_only, wait_for

__all__ = ["NEW_TOKENS", "PROMPTS", "target_only", "wait_for"]


def streams_through(address: str, fault: Callable[[], None]) -> list[Stream]:
    streams, _, _ = fault_streams.streams_through([address], fault)
    return streams


def assert_streams_whole(streams: list[Stream], expected: list[list[int]]) -> None:
    assert [stream.error for stream in streams] == [None] * STREAMS
    assert [stream.finish_reason for stream in streams] == ["length"] * STREAMS
    assert [stream.tokens for stream in streams] == expected  # no token repeated, missing or changed


def assert_nothing_held(target_address: str, draft_addresses: list[str]) -> None:
    """Waits until the target and every replica hold no request and their KV pools are whole."""
    assert held_after(target_address, draft_addresses) == (0, 0), "requests or KV blocks still held after 30 s"
