"""What a request streams: its statistics, its messages, and the stop conditions applied to its new tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from orchestrator.backends import FailureKind
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher


class RequestFailed(Exception):
    """A request that cannot go on; carries the kind of failure to report to its client."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wire_seconds: float = 0.0
    scheduling_seconds: float = 0.0

    def count_round(self, num_drafts: int, accepted: int) -> None:
        self.rounds += 1
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


@dataclass
class RequestOutput:
    """A request's output side: what it generated so far, its text state and its queue of messages."""

    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    messages: asyncio.Queue[Output | RequestFailed] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finished: bool = False

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def emit(self, new_tokens: Iterable[int], eos_token_ids: frozenset[int]) -> None:
        """Applies the stop conditions to new tokens and queues one message; tokens after a stop are dropped."""
        accepted: list[int] = []
        finish_reason = ""
        for token in new_tokens:
            accepted.append(token)
            self.generated.append(token)
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
        self.messages.put_nowait(
            Output(
                token_ids=accepted,
                text=text,
                finish_reason=finish_reason,
                stats=self.stats if finish_reason else None,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=len(self.generated),
            )
        )

    def fail(self, failure: RequestFailed) -> None:
        self.finished = True
        self.messages.put_nowait(failure)
