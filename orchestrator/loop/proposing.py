"""Asking the replicas for a step's drafts (Propose), all replicas at once, and checking what they answer.

A replica that fails, times out or sends bad drafts is at fault: it is demoted (orchestrator.loop.placement) and its
requests' round goes without drafts. A request the replica had no KV room for starts over there (its rows are
replayed by the target's next step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from orchestrator.loop.batching import ActiveRequest, Drafting, PlannedItem
from orchestrator.loop.confidence import cut_by_confidence
from orchestrator.loop.draft_length import DraftLengths
from orchestrator.loop.placement import Placement
from orchestrator.peers.backends import ProposedBatch, ProposeTask
from tandem.sampling.draft_tree import DraftTree

LOG = logging.getLogger(__name__)

Drafts = dict[str, DraftTree]  # request id -> its drafts


@dataclass(frozen=True)
class ReplicaTiming:
    call_seconds: float  # wall time of the Propose call
    compute_seconds: float  # of which the replica computed
    ahead_seconds: float = 0.0  # draft compute for the call done before it (drafted ahead)


class Proposer:
    def __init__(self, placement: Placement, speculation: DraftLengths, vocab_size: int, max_tree_drafts: int) -> None:
        self.placement = placement
        self.replicas = placement.replicas
        self.speculation = speculation
        self.vocab_size = vocab_size
        self.max_tree_drafts = max_tree_drafts  # --speculative-num-draft-tokens - 1 (and a hybrid's n-gram branch)
        # Called with (replica id, seconds) after every Propose call that answered (orchestrator.loop.metrics).
        self.listeners: list[Callable[[str, float], None]] = []
        # Tokens of draft context the replicas were asked to take from their own prefix caches, and found there.
        self.prefix_queried = 0
        self.prefix_cached = 0

    async def propose(self, decode: Sequence[PlannedItem]) -> tuple[Drafts, dict[str, ReplicaTiming]]:
        """The drafts of the step's decoding requests that have room for some, by request id (scored ones cut where
        their confidence says the rest will not pay: orchestrator.loop.confidence), and each replica's timing."""
        requests: dict[str, ActiveRequest] = {}
        by_replica: dict[str, list[ProposeTask]] = {}
        for entry in decode:
            request = entry.request
            if entry.max_drafts > 0 and request.replica is not None:
                task = ProposeTask(
                    request.request_id, request.round, entry.max_drafts, request.tokens, request.kv_length
                )
                by_replica.setdefault(request.replica, []).append(task)
                requests[request.request_id] = request
        replies = await asyncio.gather(
            *(self._timed(replica, tasks) for replica, tasks in by_replica.items()), return_exceptions=True
        )
        drafts: Drafts = {}
        timings: dict[str, ReplicaTiming] = {}
        for (replica, tasks), reply in zip(by_replica.items(), replies, strict=True):
            if isinstance(reply, BaseException):
                self.placement.replica_failed(replica, str(reply))
                continue
            batch, call_seconds = reply
            fault = self._fault(tasks, batch)
            if fault:
                self.placement.replica_failed(replica, fault)
                continue
            self._accept(replica, tasks, batch, call_seconds, requests)
            drafts.update(batch.drafts)
            timings[replica] = ReplicaTiming(call_seconds, batch.compute_seconds, batch.ahead_seconds)
        return cut_by_confidence(drafts, self.speculation, len(decode)), timings

    def _accept(
        self,
        replica: str,
        tasks: Sequence[ProposeTask],
        batch: ProposedBatch,
        call_seconds: float,
        requests: dict[str, ActiveRequest],
    ) -> None:
        """Takes a replica's checked answer: starts over the requests it had no room for, feeds the cost model."""
        for request_id, reason in batch.exhausted.items():
            LOG.warning("request %s goes without drafts this round: %s", request_id, reason)
            requests[request_id].start_over(replica)  # the replica dropped its state
        # A request new to the replica (or started over there) had every committed row ingested: that costs once
        # per request, not per draft step, and is kept apart in the cost model.
        new_rows = 0
        for task in tasks:
            request = requests[task.request_id]
            if request.drafting is Drafting.JOINING:
                new_rows += task.rows_end
                if task.request_id in batch.drafts:
                    request.drafting = Drafting.DRAFTING
        for queried, cached in batch.prefix.values():
            self.prefix_queried += queried
            self.prefix_cached += cached
        for listener in self.listeners:
            listener(replica, call_seconds)
        k = max(task.num_steps for task in tasks)
        self.speculation.costs.one_forward = batch.one_forward
        self.speculation.costs.observe_propose(len(tasks), k, call_seconds, batch.compute_seconds, new_rows)

    def _fault(self, tasks: Sequence[ProposeTask], batch: ProposedBatch) -> str:
        """What is wrong with a replica's answer ("" if nothing): a replica that sends bad drafts is at fault."""
        for task in tasks:
            if task.request_id in batch.exhausted:
                continue
            tree = batch.drafts.get(task.request_id)
            if tree is None:
                return f"no drafts for request {task.request_id}"
            fault = tree.fault(drafts_allowed(tree, task.num_steps, self.max_tree_drafts), self.vocab_size)
            if fault:
                return f"request {task.request_id}: {fault}"
        return ""

    async def _timed(self, replica: str, tasks: list[ProposeTask]) -> tuple[ProposedBatch, float]:
        started = time.perf_counter()
        batch = await self.replicas.backend(replica).propose(tasks)
        return batch, time.perf_counter() - started


def drafts_allowed(tree: DraftTree, num_steps: int, max_tree_drafts: int) -> int:
    """How many drafts a round asked for `num_steps` may carry: a chain k, a tree the nodes the step made room for
    (--speculative-num-draft-tokens - 1, and with --hybrid-ngram the branch's at most k more)."""
    return num_steps if tree.is_chain else max_tree_drafts
