"""What the scheduler needs from a target and from a draft replica, as plain dataclasses.

Two implementations: gRPC clients of separate services (orchestrator/peers/grpc_backends.py, what
`tandem serve` runs) and in-process runners (bench/colocated.py, the colocated baseline
that the benchmark compares the split against). The scheduler is the same code for both. A third DraftBackend
needs no draft process at all: prompt lookup over the request's own tokens (orchestrator/loop/ngram.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.logprobs import TokenLogprob
from tandem.sampling.params import SamplingParams


class FailureKind(Enum):
    INVALID = "invalid"  # the request itself is wrong
    EXHAUSTED = "exhausted"  # no KV space, or no queue room, now
    UNAVAILABLE = "unavailable"  # the service is unreachable or broken


class BackendError(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PromptImage:
    """An image of a request's prompt: its placeholder tokens are prompt tokens [start, end)."""

    start: int
    end: int
    data: bytes  # as encoded (PNG, JPEG, WebP)
    digest: str  # sha256 of data, hex
    crop: int = 0  # 0: the image itself; k: its k-th pan-and-scan crop


@dataclass(frozen=True)
class OpenRequest:
    """What a request's first step item carries to the target."""

    prompt: Sequence[int]
    sampling: SamplingParams
    end_token_ids: frozenset[int] = frozenset()  # a multi-token decode stops after one of these
    generated: Sequence[int] = ()  # tokens generated before: a request resumed on a restarted target
    cache_salt: str = ""  # mixed into the names of its prefix-cache blocks
    images: Sequence[PromptImage] = ()


@dataclass(frozen=True)
class StepItem:
    """One request's share of a target step: the wire's StepItem, target_server.items.StepItem on the other side.

    It computes the next num_tokens committed tokens from where the request's KV ends; one that reaches the last
    committed token also verifies its drafts and commits new tokens.
    """

    request_id: str
    round: int  # the hidden rows this item commits are published under this round
    num_tokens: int
    drafts: DraftTree = field(default_factory=DraftTree)  # to verify after the last committed token
    open: OpenRequest | None = None  # on the request's first item
    # With open, or with move: where the target's hidden rows go (None: nowhere, target-only). With move and
    # replay the target also resends every committed row, for a replica that starts the request from scratch.
    replica: str | None = None
    move: bool = False
    replay: bool = False
    top_logprobs: int | None = None  # report the new tokens' logprobs and this many best tokens; None: no logprobs
    decode_steps: int = 1  # without drafts: decode up to this many tokens in this one step (a forward pass each)
    # When this item commits tokens, the replica its rows go to may draft this many steps for the next round at once,
    # before it is asked (0: when asked). A backend whose draft cannot run beside the target ignores it.
    draft_ahead: int = 0


@dataclass(frozen=True)
class StepResult:
    request_id: str
    failure: BackendError | None  # INVALID: the item is wrong; EXHAUSTED: no KV room now (nothing changed)
    accepted: int = 0
    new_tokens: list[int] = field(default_factory=list)  # empty for a prompt chunk
    streaming: bool = False  # hidden rows go to the request's replica
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token when the item asked
    cached_tokens: int = 0  # tokens of the item the target took from its prefix cache


@dataclass(frozen=True)
class StepOutcome:
    results: list[StepResult]  # one per item, in order
    compute_seconds: float
    kv_blocks_free: int | None = None  # the target's, after the step (cached blocks count free); None: not told


@dataclass(frozen=True)
class ProposeTask:
    request_id: str
    round: int
    num_steps: int
    # The request's committed tokens (prompt, then generated), for drafters that read tokens rather than the target's
    # hidden rows (orchestrator/loop/ngram.py); a draft replica over gRPC has its own copy and ignores them.
    tokens: Sequence[int] = ()
    # Positions the target's rows reach for this round: the request's positions with KV on the target. A replica
    # proposes once its rows reach them (they may come in several messages).
    rows_end: int = 0


@dataclass(frozen=True)
class ProposedBatch:
    drafts: dict[str, DraftTree]  # request id -> its drafts (target vocabulary ids)
    # Requests the replica had no KV room for: it dropped their state, so the target must replay their rows.
    exhausted: dict[str, str]  # request id -> why
    compute_seconds: float
    # Draft compute for these requests done before the call (drafted ahead, StepItem.draft_ahead); compute_seconds
    # is what the call still waited for.
    ahead_seconds: float = 0.0
    # The replica drafts any number of tokens in one forward (a block drafter): its compute does not grow with k.
    one_forward: bool = False
    # Per request whose rows skipped a prefix the target had cached: the positions it asked of the replica's own
    # prefix cache, and those it found there (all, or 0 with the request in `exhausted`).
    prefix: dict[str, tuple[int, int]] = field(default_factory=dict)


class TargetBackend(Protocol):
    async def step(self, items: Sequence[StepItem], preempt: Sequence[str]) -> StepOutcome:
        """Frees the KV of `preempt` (the target keeps their tokens), then runs the items in one forward pass."""
        ...

    async def release(self, request_ids: Sequence[str]) -> None: ...

    async def answer(self) -> bool:
        """Asks the target who answers now: True when it is another instance than the one the backend's steps
        went to (a target restarted at the same address, holding none of their requests; later steps go to the new
        one), False when it is the same. Raises BackendError when none answers."""
        ...


class DraftBackend(Protocol):
    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch: ...

    async def release(self, request_ids: Sequence[str]) -> None: ...

    async def probe(self) -> None:
        """Returns when the replica answers (a demoted replica rejoins then); raises BackendError otherwise."""
        ...
