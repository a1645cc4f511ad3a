"""A demoted draft replica is probed again with backoff (orchestrator.loop.placement): first after 1 s, or after
--reprobe-max-interval if that is shorter, each failed probe doubling the wait up to --reprobe-max-interval; once a
probe answers, the replica serves new requests again."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import pytest

from orchestrator.loop import placement
from orchestrator.loop.draft_length import DraftLengths
from orchestrator.loop.placement import Placement
from orchestrator.peers.backends import BackendError, FailureKind, ProposedBatch, ProposeTask
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings


class FlakyDraft:
    """A replica that fails its first `failures` probes, then answers; keeps when each probe came."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.probes: list[float] = []

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        raise AssertionError("a demoted replica is not asked for drafts")

    async def release(self, request_ids: Sequence[str]) -> None:
        raise AssertionError("it held no request")

    async def probe(self) -> None:
        self.probes.append(time.monotonic())
        if len(self.probes) <= self.failures:
            raise BackendError(FailureKind.UNAVAILABLE, "not yet")


async def waits_until_restored(longest_s: float, failures: int) -> tuple[list[float], bool]:
    """Demotes a replica that answers its probe after `failures` failed ones; the waits before each probe, and
    whether it serves once restored."""
    draft, replicas, woken = FlakyDraft(failures), ReplicaPool(), asyncio.Event()
    replicas.add("draft-0", "draft-0", draft)

    async def forget(replica_id: str, request_ids: Sequence[str]) -> None:
        pass

    settings = SchedulerSettings(reprobe_max_s=longest_s)
    placed = Placement(replicas, settings, DraftLengths(max_k=3), lambda: [], woken.set, forget)
    replica = replicas.get("draft-0")
    assert replica is not None
    demoted = time.monotonic()
    placed.replica_failed("draft-0", "a test")
    assert replica.demoted
    await asyncio.wait_for(woken.wait(), timeout=10)  # restored: the scheduler is woken
    times = [demoted, *draft.probes]
    return [later - earlier for earlier, later in itertools.pairwise(times)], not replica.demoted


def test_the_wait_doubles_from_the_first_up_to_the_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "FIRST_REPROBE_S", 0.1)  # 1 s in service: the same shape, 10 times faster
    waits, serving = asyncio.run(waits_until_restored(longest_s=0.4, failures=3))
    assert serving and len(waits) == 4
    # Doubled, then held at the longest (not 0.8); the slack is for a loaded machine's late wake-ups.
    for wait, planned in zip(waits, (0.1, 0.2, 0.4, 0.4), strict=True):
        assert planned - 0.01 <= wait < planned + 0.3, waits


def test_a_longest_wait_below_the_first_is_every_wait() -> None:
    waits, serving = asyncio.run(waits_until_restored(longest_s=0.1, failures=2))
    assert serving and len(waits) == 3
    assert all(0.09 <= wait < 0.5 for wait in waits), waits  # not 1 s, not doubling
