"""What a request streams: its statistics, its messages, and the stop conditions applied to its new tokens."""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from orchestrator.loop.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.loop.validation import InvalidRequest, ValidatedRequest
from orchestrator.peers.backends import FailureKind
from tandem.sampling.logprobs import TokenLogprob


class RequestFailed(Exception):
    """A request that cannot go on; carries the kind of failure to report to its client."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ShuttingDown(RequestFailed):
    """A request refused, or ended, because the orchestrator is shutting down: the client may retry it elsewhere
    (the HTTP API answers 503 with Retry-After)."""

    retry_after_s = 1

    def __init__(self, message: str) -> None:
        super().__init__(FailureKind.UNAVAILABLE, message)


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
    draft_ahead_seconds: float = 0.0  # draft compute done before the Propose that took it (off the round's path)
    cached_tokens: int = 0  # prompt tokens the target took from its prefix cache on the prefill that gave token 1
    # Latencies of the request as its client sees them, from its arrival at the scheduler.
    queue_seconds: float = 0.0  # arrival to first admission into the running batch
    first_token_seconds: float = 0.0  # arrival to the first message with tokens
    inter_token_seconds: list[float] = field(default_factory=list)  # between consecutive messages with tokens
    total_seconds: float = 0.0  # arrival to the last message

    def count_round(self, num_drafts: int, depth: int, accepted: int) -> None:
        """One verification round of `num_drafts` drafts (a chain's, or a tree's nodes) that could add `depth` tokens
        at most (the chain's length, the tree's depth), of which `accepted` were. accepted_per_position[i] counts the
        rounds that accepted a draft at depth i + 1, so it is as long as the deepest round, tree or chain. A
        constrained request's target may verify more than were drafted (tokens its grammar forces), so `accepted`
        may exceed `depth`."""
        self.rounds += 1
        if num_drafts:
            self.draft_rounds += 1
        self.draft_tokens += num_drafts
        self.accepted_tokens += accepted
        longest = max(depth, accepted)
        if len(self.accepted_per_position) < longest:
            self.accepted_per_position.extend([0] * (longest - len(self.accepted_per_position)))
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
    """A request's output side: what it generated so far, its text state and its queue of messages.

    `generated` holds every committed token (the scheduler's view); the client is given them as their text is
    given. With stop strings that can lag: a token whose text may begin a stop string is held back with that text,
    and a stop string ends the answer with the last token whose text starts before it (worked example in emit).
    """

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
    completion_tokens: int = 0  # tokens of `generated` given to the client
    # With stop strings only: where each generated token's text starts, in characters of the detokenized output
    # before any cut (text_length so far), and the characters given to the client.
    token_starts: list[int] = field(default_factory=list)
    text_length: int = 0
    given_length: int = 0
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of generated[completion_tokens:], when asked

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
        so are their logprobs (one per new token, when the request asked for them).

        Stop string "###", tokens "a", " #", "##", "b" committed in one round: their text starts at 0, 1, 3, 5 of
        "a ###b"; the stop string starts at 2, so the answer is the text "a " and the tokens "a", " #" (the last
        one whose text starts before the stop string). Committed over two rounds ("a", " #", then "##", "b") the
        answer is the same: the first message gives "a " (its "#" is held back: it may begin "###") and both tokens,
        the second no text and no token.
        """
        accepted, output = self._advance(new_tokens, eos_token_ids, logprobs)
        self._time(bool(accepted))
        self.messages.put_nowait(output)

    def resume(self, tokens: Sequence[int], eos_token_ids: frozenset[int]) -> None:
        """Takes the tokens a broken stream of the request sent (resume_token_ids) as generated and given: the stop
        conditions, the text and the counts go on after them as if this stream had sent them. Where they end the
        request (their last one is an end, or the max_new_tokens-th), its one message is the last, with no tokens.
        Raises ValueError naming the first token a stream would not have sent (e.g. "[4]: ... after it ended")."""
        if not tokens:
            return
        accepted, output = self._advance(tokens, eos_token_ids, ())
        sent = len(accepted) if not output.finish_reason else min(len(accepted), output.completion_tokens)
        if sent < len(tokens):
            raise ValueError(f"[{sent}]: the stream ended before this token ({output.finish_reason})")
        self.completion_tokens = len(tokens)
        if self.finished:
            self._time(False)
            self.messages.put_nowait(replace(output, token_ids=[], text="", logprobs=[]))

    def _advance(
        self, new_tokens: Iterable[int], eos_token_ids: frozenset[int], logprobs: Sequence[TokenLogprob]
    ) -> tuple[list[int], Output]:
        """Commits new tokens up to a stop; returns those taken and the message that gives what the client may see."""
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
        self.held_logprobs += logprobs[: len(accepted)]
        text = self._detokenize(accepted)
        if finish_reason:
            flushed = self.detokenizer.flush()
            self.text_length += len(flushed)
            text += flushed
        text, stopped = self.stop.feed(text)
        if stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self.stop.flush()
        self.given_length += len(text)
        self.finished = bool(finish_reason)
        # A resumed stream's client has every token it sent, though their text may still be held back.
        given = max(self._tokens_given(stopped), self.completion_tokens)
        count = given - self.completion_tokens
        token_ids = self.generated[self.completion_tokens : given]
        given_logprobs, self.held_logprobs = self.held_logprobs[:count], self.held_logprobs[count:]
        self.completion_tokens = given
        output = Output(
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            stats=self.stats if finish_reason else None,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=given,
            logprobs=given_logprobs,
        )
        return accepted, output

    def _detokenize(self, tokens: list[int]) -> str:
        """The text of new tokens; with stop strings one token at a time, recording where each one's text starts."""
        if not self.stop.strings:
            return self.detokenizer.push(tokens)
        pieces = []
        for token in tokens:
            self.token_starts.append(self.text_length)
            piece = self.detokenizer.push([token])
            self.text_length += len(piece)
            pieces.append(piece)
        return "".join(pieces)

    def _tokens_given(self, stopped: bool) -> int:
        """How many generated tokens the client has once this message is sent: all of them, except that with stop
        strings only tokens whose text starts in the text given so far (which a stop string ends)."""
        if not self.stop.strings or (self.finished and not stopped):
            return len(self.generated)
        return bisect.bisect_left(self.token_starts, self.given_length)

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


def request_output(
    params: ValidatedRequest, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int]
) -> RequestOutput:
    """A new request's output side; a resumed one's has taken the tokens its broken stream sent (finished, when they
    ended it). Raises InvalidRequest naming the first of them a stream would not have sent."""
    output = RequestOutput(
        prompt_tokens=len(params.input_ids),
        max_new_tokens=params.max_new_tokens,
        ignore_eos=params.ignore_eos,
        detokenizer=IncrementalDetokenizer(tokenizer, params.input_ids),
        stop=StopStringMatcher(params.stop),
        stop_token_ids=params.stop_token_ids,
    )
    try:
        output.resume(params.resumed, eos_token_ids)
    except ValueError as error:
        raise InvalidRequest(f"resume_token_ids{error}") from None
    return output
