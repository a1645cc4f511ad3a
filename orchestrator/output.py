"""What a request streams: its statistics, its messages, and the stop conditions applied to its new tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from orchestrator.backends import FailureKind
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from tandem.sampling.logprobs import TokenLogprob


class RequestFailed(Exception):
    """A request that cannot go on; carries the kind of failure to report to its client."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Stats:
    rounds: int = 0
    draft_rounds: int = 0  # rounds that verified at least one draft token (vLLM's num_drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wire_seconds: float = 0.0
    scheduling_seconds: float = 0.0
    # Latencies of the request as its client sees them, from its arrival at the scheduler.
    queue_seconds: float = 0.0  # arrival to first admission into the running batch
    first_token_seconds: float = 0.0  # arrival to the first message with tokens
    inter_token_seconds: list[float] = field(default_factory=list)  # between consecutive messages with tokens
    total_seconds: float = 0.0  # arrival to the last message

    def count_round(self, num_drafts: int, accepted: int) -> None:
        self.rounds += 1
        if num_drafts:
            self.draft_rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


@dataclass(frozen=True)
class Output:
    """One streamed message of a request, in our own terms (the service converts it to protobuf)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "" until the last message
    stats: Stats | None  # on the last message
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id when the request asked


@dataclass
class RequestOutput:
    """A request's output side: what it generated so far, its text state and its queue of messages."""

    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    stop_token_ids: frozenset[int] = frozenset()
    messages: asyncio.Queue[Output | RequestFailed] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finished: bool = False
    arrived: float = field(default_factory=time.monotonic)
    scheduled: bool = False  # admitted into the running batch at least once
    last_message: float | None = None  # when the last message with tokens was queued

    def mark_scheduled(self) -> None:
        """Called when the request enters the running batch; the first time ends its queue time."""
        if not self.scheduled:
            self.scheduled = True
            self.stats.queue_seconds = time.monotonic() - self.arrived

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def emit(
        self, new_tokens: Iterable[int], eos_token_ids: frozenset[int], logprobs: Sequence[TokenLogprob] = ()
    ) -> None:
        """Applies the stop conditions to new tokens and queues one message; tokens after a stop are dropped, and
        so are their logprobs (one per new token, when the request asked for them)."""
        accepted: list[int] = []
        finish_reason = ""
        for token in new_tokens:
            accepted.append(token)
            self.generated.append(token)
            if token in self.stop_token_ids:
                finish_reason = "stop"
                break
            if token in eos_token_ids and not self.ignore_eos:
                finish_reason = "eos"
                break
            if self.remaining <= 0:
                finish_reason = "length"
                break
        text = self.detokenizer.push(accepted)
        if finish_reason:
            text += self.detokenizer.flush()
        text, stopped = self.stop.feed(text)
        if stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self.stop.flush()
        self.finished = bool(finish_reason)
        self._time(bool(accepted))
        self.messages.put_nowait(
            Output(
                token_ids=accepted,
                text=text,
                finish_reason=finish_reason,
                stats=self.stats if finish_reason else None,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=len(self.generated),
                logprobs=list(logprobs[: len(accepted)]),
            )
        )

    def _time(self, has_tokens: bool) -> None:
        now = time.monotonic()
        if has_tokens:
            if self.last_message is None:
                self.stats.first_token_seconds = now - self.arrived
            else:
                self.stats.inter_token_seconds.append(now - self.last_message)
            self.last_message = now
        if self.finished:
            self.stats.total_seconds = now - self.arrived

    def fail(self, failure: RequestFailed) -> None:
        self.finished = True
        self.messages.put_nowait(failure)
