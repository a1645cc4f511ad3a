"""Streams in flight through a fault, for the fault tests: 8 greedy and 2 seeded sampled Generate calls, each read on
its own thread, and the checks that each ended as a run without the fault and without speculation would have (no
token repeated, missing or changed), with nothing left held on the target or the replicas.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import draft_info, generate, target_info

GREEDY = 8
NEW_TOKENS = 32
PROMPTS = [[1, 17 + i, 42, 99, 5, 23 + 3 * i] for i in range(GREEDY)]
# 8 greedy streams and 2 seeded sampled ones: a seed pins the tokens (tandem.sampling.verify, seeded_scores).
REQUESTS: list[dict[str, Any]] = [
    *({"input_ids": prompt} for prompt in PROMPTS),
    *({"input_ids": PROMPTS[i], "temperature": 0.8, "seed": 100 + i} for i in range(2)),
]
STREAMS = len(REQUESTS)


@dataclass
class Stream:
    """One Generate call read on its own thread: every streamed token in order, and how it ended."""

    address: str
    fields: dict[str, Any]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: grpc.RpcError | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        request = orchestrator_pb2.GenerateRequest(**self.fields, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        try:
            with grpc.insecure_channel(self.address, options=channel_options()) as channel:
                for response in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=120):
                    self.tokens.extend(response.token_ids)
                    self.started.set()
                    self.finish_reason = response.finish_reason or self.finish_reason
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.started.set()
            self.done.set()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def target_only(address: str) -> list[list[int]]:
    """What each of REQUESTS gives without speculation and without a fault."""
    fields = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "disable_speculation": True}
    return [generate(address, **request, **fields).token_ids for request in REQUESTS]


def streams_through(address: str, fault: Callable[[], None]) -> list[Stream]:
    """REQUESTS as streams; `fault` runs once every one of them has streamed a token; returns them once all ended."""
    streams = [Stream(address, request) for request in REQUESTS]
    for stream in streams:
        assert stream.started.wait(60)
    assert not any(stream.done.is_set() for stream in streams), "a stream ended before the fault"
    fault()
    for stream in streams:
        assert stream.done.wait(120)
    return streams


def assert_streams_whole(streams: list[Stream], expected: list[list[int]]) -> None:
    assert [stream.error for stream in streams] == [None] * STREAMS
    assert [stream.finish_reason for stream in streams] == ["length"] * STREAMS
    assert [stream.tokens for stream in streams] == expected  # no token repeated, missing or changed


def assert_nothing_held(target_address: str, draft_addresses: list[str]) -> None:
    """Waits until the target and every replica hold no request and their KV pools are whole."""

    def idle() -> bool:
        target = target_info(target_address)
        drafts = [draft_info(address) for address in draft_addresses]
        return (target.running_requests, target.kv_blocks_total - target.kv_blocks_free) == (0, 0) and all(
            (draft.running_requests, draft.kv_blocks_total - draft.kv_blocks_free) == (0, 0) for draft in drafts
        )

    wait_for(idle, "every request and KV block back on the target and the replicas", 30)
