"""Drafting ahead: a step's rows that carry `draft_ahead` are drafted as one batch on the model thread as soon as the
step's last message arrives, while the target's answer travels to the orchestrator and its Propose travels here.

`DraftedAhead` is one request's share of such a batch; the functions here settle a batch's outcome onto its requests
and decide what a Propose may take of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from draft_server.proposals import ProposalRunner, Proposals, propose_what_fits
from draft_server.runner import DraftRequestError, ProposeInput, TargetRows
from tandem.grpc_util import CallFailed
from tandem.sampling.draft_tree import DraftTree

LOG = logging.getLogger(__name__)
Key = tuple[str, int]  # (request id, round)


@dataclass
class DraftedAhead:
    """One request's drafts made ahead, from `rows`, for `num_steps` steps; `done` once the batch ran."""

    rows: TargetRows
    num_steps: int
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    proposal: DraftTree | None = None  # None until the batch ran, or when it could not draft the request
    exhausted: str | None = None  # why the pool could not hold the request (it was dropped, like a Propose's)
    prefix: tuple[int, int] = (0, 0)  # prefix positions asked of the replica's cache and found (Proposals)
    started: float = 0.0  # perf_counter at the start and end of its batch's compute
    finished: float = 0.0


def timed_proposals(
    runner: ProposalRunner, inputs: Sequence[ProposeInput]
) -> tuple[Proposals, float, float]:  # -> proposals, started, finished
    started = time.perf_counter()
    proposals = propose_what_fits(runner, inputs)
    return proposals, started, time.perf_counter()


def settle(batch: Mapping[Key, DraftedAhead], done: asyncio.Future[Any]) -> None:
    """Hands each request of a draft-ahead batch its outcome; a failed batch fails each of them."""
    if done.cancelled():  # the model thread shut down with the batch still queued
        for made in batch.values():
            made.done.cancel()
        return
    error = done.exception()
    if error is None:
        proposals, started, finished = done.result()
    for (request_id, _), made in batch.items():
        if error is not None:
            made.done.set_exception(error)
            made.done.exception()  # retrieved: a Propose that asks still gets it; one nobody asks for is not logged
            continue
        made.proposal, made.exhausted = proposals.drafts.get(request_id), proposals.exhausted.get(request_id)
        made.prefix = proposals.prefix.get(request_id, (0, 0))
        made.started, made.finished = started, finished
        made.done.set_result(None)
    if error is not None and not isinstance(error, DraftRequestError):
        LOG.error("drafting ahead for %d requests failed: %r", len(batch), error)


def batch_failure(request_id: str, made: DraftedAhead) -> CallFailed | None:
    """Why a settled draft-ahead batch failed for a request (as a Propose's drafting would have), or None."""
    if made.done.cancelled():
        return CallFailed(grpc.StatusCode.UNAVAILABLE, f"request {request_id!r}: the replica is stopping")
    error = made.done.exception()
    return drafting_failure(request_id, error) if isinstance(error, Exception) else None


def drafting_failure(request_id: str, error: Exception) -> CallFailed:
    if isinstance(error, DraftRequestError):
        return CallFailed(grpc.StatusCode.FAILED_PRECONDITION, f"request {request_id!r}: {error}")
    return CallFailed(grpc.StatusCode.INTERNAL, f"request {request_id!r}: drafting ahead failed: {error!r}")


def usable_drafts(made: DraftedAhead, num_steps: int, chains: bool) -> DraftTree | None:
    """The drafts made ahead as a Propose for num_steps takes them: all when the steps match, the first num_steps
    of a longer chain (`chains`: the runner drafts chains); None when they must be drafted again (a longer chain, or
    a tree of another size)."""
    if made.num_steps == num_steps:
        return made.proposal
    if chains and made.proposal is not None and num_steps < made.num_steps:
        return made.proposal.first(num_steps)
    return None


def drop_stale(
    rows: dict[Key, tuple[TargetRows, float]],
    ahead: dict[Key, tuple[DraftedAhead, float]],
    released: dict[str, float],
    oldest: float,  # monotonic time: what came before it and nobody asked for since is stale
) -> dict[str, float]:
    """Drops the rows of requests that got none since `oldest`: rows of a request's last round arrive after it
    finished, and nobody asks for them (a running request at k = 0 keeps getting rows every round, so its rows stay
    until it drafts again); and drafts made ahead for a round nobody asked for (the request finished, moved, or went
    on target-only). Returns the releases to remember: those since `oldest`."""
    latest: dict[str, float] = {}
    for (request_id, _), (_, arrived) in rows.items():
        latest[request_id] = max(arrived, latest.get(request_id, arrived))
    for key in [key for key in rows if latest[key[0]] < oldest]:
        del rows[key]
    for key in [key for key, (_, made_at) in ahead.items() if made_at < oldest]:
        del ahead[key]
    return {request_id: at for request_id, at in released.items() if at >= oldest}
