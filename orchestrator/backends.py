"""What the scheduler needs from a target and from a draft replica, as plain dataclasses.

Two implementations: gRPC clients of separate services (orchestrator/grpc_backends.py, what
`tandem serve` runs) and in-process runners (orchestrator/local_backends.py, the colocated baseline
that the benchmark compares the split against). The scheduler is the same code for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tandem.sampling.params import SamplingParams


class FailureKind(Enum):
    INVALID = "invalid"  # the request itself is wrong
    EXHAUSTED = "exhausted"  # no KV space now; retry when running requests finish
    UNAVAILABLE = "unavailable"  # the service is unreachable or broken


class BackendError(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PrefillTask:
    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingParams
    replica: str | None  # the draft replica that receives the target's hidden states; None: target-only


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    streaming: bool  # hidden states go to the requested replica (False: it is gone; target-only for now)


@dataclass(frozen=True)
class VerifyTask:
    request_id: str
    draft_tokens: Sequence[int]
    round: int  # the hidden states of this verification are published under this round


@dataclass(frozen=True)
class Verified:
    request_id: str
    accepted: int
    new_tokens: list[int]  # accepted drafts + correction or bonus token


@dataclass(frozen=True)
class VerifiedBatch:
    results: list[Verified]
    compute_seconds: float


@dataclass(frozen=True)
class ReassignTask:
    request_id: str
    replica: str | None  # None: target-only from now on
    round: int  # the replayed hidden states are published under this round


@dataclass(frozen=True)
class ProposeTask:
    request_id: str
    round: int
    num_steps: int


@dataclass(frozen=True)
class ProposedBatch:
    drafts: dict[str, list[int]]  # request id -> draft tokens (target vocabulary)
    compute_seconds: float


class TargetBackend(Protocol):
    async def prefill(self, tasks: Sequence[PrefillTask]) -> list[Prefilled]: ...

    async def verify(self, tasks: Sequence[VerifyTask]) -> VerifiedBatch: ...

    async def reassign(self, tasks: Sequence[ReassignTask]) -> list[bool]:
        """Moves requests to another replica, replaying their hidden states to it; returns `streaming` per task."""
        ...

    async def release(self, request_ids: Sequence[str]) -> None: ...


class DraftBackend(Protocol):
    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch: ...

    async def release(self, request_ids: Sequence[str]) -> None: ...
