"""Streams in flight through a fault (bench.faults and the fault tests): 8 greedy and 2 seeded sampled Generate calls,
each read on its own thread with the time each chunk arrived, and what the target and replicas still hold after.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from bench.fault_stack import Signalled
from tandem.grpc_util import channel_options
from tandem.resuming import Reconnects, StreamBroken, resuming_stream
from tandem.wire import draft_pb2, draft_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc

GREEDY = 8
NEW_TOKENS = 32
PROMPTS = [[1, 17 + i, 42, 99, 5, 23 + 3 * i] for i in range(GREEDY)]
# 8 greedy streams and 2 seeded sampled ones: a seed pins the tokens (tandem.sampling.verify, seeded_scores).
REQUESTS: list[dict[str, Any]] = [
    *({"input_ids": prompt} for prompt in PROMPTS),
    *({"input_ids": PROMPTS[i], "temperature": 0.8, "seed": 100 + i} for i in range(2)),
]
STREAMS = len(REQUESTS)
STREAM_TIMEOUT_S = 120.0  # a stream not ended by then counts as hung


@dataclass
class Stream:
    """One Generate call read on its own thread: every streamed token in order, when each chunk came, how it ended.
    With `resuming`, the client resumes a broken stream (tandem.resuming) at the next of `addresses`."""

    addresses: tuple[str, ...]
    fields: dict[str, Any]
    resuming: bool = False
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # time.monotonic() of each chunk
    finish_reason: str = ""
    error: grpc.RpcError | StreamBroken | None = None
    resumes: int = 0  # reconnections
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        request = orchestrator_pb2.GenerateRequest(**self.fields, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        reconnects = Reconnects(attempts=8 if self.resuming else 0)
        try:
            for response in resuming_stream(
                self.addresses,
                request,
                lambda address: grpc.insecure_channel(address, options=channel_options()),
                timeout_s=STREAM_TIMEOUT_S,
                reconnects=reconnects,
                on_reconnect=self._resumed,
            ):
                self.arrivals.append(time.monotonic())
                self.tokens.extend(response.token_ids)
                self.started.set()
                self.finish_reason = response.finish_reason or self.finish_reason
        except (grpc.RpcError, StreamBroken) as error:
            self.error = error
        finally:
            self.started.set()
            self.done.set()

    def _resumed(self, address: str, cause: str, tokens: int) -> None:
        self.resumes += 1

    def longest_gap_after(self, moment: float) -> float:
        """The longest wait between chunks (or from `moment` to the first chunk after it), from `moment` on."""
        times = [moment, *(arrival for arrival in self.arrivals if arrival > moment)]
        return max((later - earlier for earlier, later in itertools.pairwise(times)), default=0.0)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def completion(address: str, **fields: Any) -> orchestrator_pb2.GenerateResponse:
    """One whole Generate call: its responses folded into one (tokens, finish reason, the last stats)."""
    folded = orchestrator_pb2.GenerateResponse()
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        for response in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(
            orchestrator_pb2.GenerateRequest(**fields), timeout=STREAM_TIMEOUT_S
        ):
            folded.token_ids.extend(response.token_ids)
            folded.finish_reason = response.finish_reason or folded.finish_reason
            folded.stats.CopyFrom(response.stats)
    return folded


def target_only(address: str) -> list[list[int]]:
    """What each of REQUESTS gives without speculation and without a fault; all at once, as the streams run (neither
    greedy nor seeded tokens depend on the batch)."""
    fields = {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, "disable_speculation": True}
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda request: list(completion(address, **request, **fields).token_ids), REQUESTS))


def streams_through(
    addresses: Sequence[str], fault: Callable[[], Signalled | None], resuming: bool = False
) -> tuple[list[Stream], float, Signalled | None]:
    """REQUESTS as streams to `addresses` (the first, then the next as they resume); `fault` runs once every one of
    them has streamed a token. Returns the streams once each ended or hung, when the fault began, and what it saw."""
    streams = [Stream(tuple(addresses), request, resuming) for request in REQUESTS]
    for stream in streams:
        if not stream.started.wait(60):
            raise AssertionError("a stream did not start within 60 s")
    if any(stream.done.is_set() for stream in streams):
        raise AssertionError("a stream ended before the fault")
    began = time.monotonic()
    seen = fault()
    for stream in streams:
        stream.done.wait(max(0.0, began + STREAM_TIMEOUT_S + 5 - time.monotonic()))
    return streams, began, seen


def target_info(address: str) -> target_pb2.TargetInfo:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        info: target_pb2.TargetInfo = target_pb2_grpc.TargetStub(channel).GetInfo(
            target_pb2.TargetInfoRequest(), timeout=10
        )
        return info


def draft_info(address: str) -> draft_pb2.DraftInfo:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        info: draft_pb2.DraftInfo = draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)
        return info


def held(target_address: str, draft_addresses: Sequence[str]) -> tuple[int, int]:
    """Requests and KV blocks the target and the replicas hold now, summed over them."""
    target = target_info(target_address)
    drafts = [draft_info(address) for address in draft_addresses]
    requests = target.running_requests + sum(draft.running_requests for draft in drafts)
    blocks = target.kv_blocks_total - target.kv_blocks_free
    return requests, blocks + sum(draft.kv_blocks_total - draft.kv_blocks_free for draft in drafts)


def held_after(target_address: str, draft_addresses: Sequence[str], settle_s: float = 30.0) -> tuple[int, int]:
    """What the target and replicas still hold once they have had `settle_s` to let go (sooner when nothing is)."""
    deadline = time.monotonic() + settle_s
    while (now := held(target_address, draft_addresses)) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return now
