"""The scheduler loop: one target step after another, each chosen by orchestrator.loop.batching.

A step: free cancelled requests; choose each decoding request's k (orchestrator.loop.draft_length); choose the step
(decoding requests first, preempting the newest when the KV pool is short, then prompt chunks); ask each replica for
its decoding requests' drafts; run the step on the target; emit each request's new tokens; release finished ones.

Round numbers join the draft's two inputs: every item a request sends publishes its hidden rows under round + 1, and
the item that commits new tokens moves the request to that round; the draft proposes for round r from the rows
published under r (a long prompt's chunks, or a replay and the rows after it, come as several messages of one round,
joined by the draft). The scheduler talks to TargetBackend / DraftBackend (orchestrator/peers/backends.py), so the
same steps run against gRPC services or in-process runners.

Failures stay with the request they belong to: an item the target refuses fails that request alone; an item that
finds no KV room waits for the next step; a replica that fails, times out or proposes bad tokens is demoted
(orchestrator.loop.placement); a target that stops answering costs time only: every request starts over on the target
that answers next (orchestrator.peers.recovery). Drafts come from orchestrator.loop.proposing, releases go out through
orchestrator.loop.releases, and a step's costs and statistics are counted by orchestrator.loop.accounting.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from orchestrator.loop.accounting import StepTimes, count_round, observe_target_cost
from orchestrator.loop.batching import ActiveRequest, Drafting, KVPool, OnTarget, PlannedItem, StepPlan, plan_step
from orchestrator.loop.draft_length import Asking, DraftLengths, request_class
from orchestrator.loop.output import RequestFailed, request_output
from orchestrator.loop.placement import Placement
from orchestrator.loop.proposing import Drafts, Proposer
from orchestrator.loop.releases import RELEASE_RETRY_S, Releases
from orchestrator.loop.speculation import RoundCosts
from orchestrator.loop.validation import InvalidRequest, ValidatedRequest, with_stop_masking
from orchestrator.peers.backends import (
    BackendError,
    FailureKind,
    OpenRequest,
    StepItem,
    StepOutcome,
    StepResult,
    TargetBackend,
)
from orchestrator.peers.recovery import TargetGone, reach_target
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings
from tandem.sampling.draft_tree import DraftTree

LOG = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue holds its maximum; the message says how many."""


@dataclass(frozen=True)
class TargetFacts:
    """What the scheduler needs to know of the target."""

    vocab_size: int
    pool: KVPool
    max_draft_tokens: int


class Scheduler:
    def __init__(
        self,
        target: TargetBackend,
        replicas: ReplicaPool,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int],
        settings: SchedulerSettings,
        facts: TargetFacts,
    ) -> None:
        self.target = target
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.settings = settings
        self.facts = facts
        self.waiting: deque[ActiveRequest] = deque()
        self.running: dict[str, ActiveRequest] = {}  # in admission order
        self.last_progress = time.monotonic()  # when the loop last finished a step (health)
        self.target_failure: str | None = None  # why the target's last step or release failed; None once it answers
        self.held_elsewhere = 0  # KV blocks other orchestrators of the target held after the last step (estimated)
        costs = RoundCosts(settings.num_scheduler_steps)
        self.speculation = DraftLengths(settings.num_steps, settings.adaptive_k, costs)
        self.k_in_use = settings.num_steps  # the deepest k of the last step (metrics)
        self.judged = 0  # the batch size the last step's k were chosen for (speculating requests)
        self.releases = Releases(target, replicas, self._target_answered)
        forget = self.releases.release_on
        self.placement = Placement(
            replicas, settings, self.speculation, self._requests, self.wake, forget, facts.pool.block_size
        )
        self.proposer = Proposer(self.placement, self.speculation, facts.vocab_size, settings.max_tree_drafts)
        self._wake = asyncio.Event()

    def submit(self, params: ValidatedRequest) -> ActiveRequest:
        """Queues a request; raises InvalidRequest when it can never fit the KV pool, QueueFull when the queue is."""
        params = with_stop_masking(params, self.eos_token_ids)
        positions = len(params.input_ids) + params.max_new_tokens
        pool = self.facts.pool
        if not pool.fits_alone(positions):
            raise InvalidRequest(
                f"max_new_tokens: a {len(params.input_ids)}-token prompt and {params.max_new_tokens} new tokens need "
                f"{pool.blocks(positions)} KV blocks of {pool.block_size} tokens; the target's KV pool holds "
                f"{pool.num_blocks} blocks ({pool.num_blocks * pool.block_size} tokens, --kv-blocks)"
            )
        if len(self.waiting) >= self.settings.max_waiting:
            raise QueueFull(
                f"the waiting queue holds its maximum of {self.settings.max_waiting} requests (--max-waiting); "
                "retry later"
            )
        output = request_output(params, self.tokenizer, self.eos_token_ids)
        if output.finished:  # a resume of a stream that had ended: its last message is queued already
            return ActiveRequest(uuid.uuid4().hex, params, output, None)
        replica, paused = self.placement.admit(params, len(self.running) + 1)
        request = ActiveRequest(uuid.uuid4().hex, params, output, replica)
        if paused:
            request.pause()
        if not self.waiting and not self.running:  # work arrives at an idle loop: the stall clock starts now
            self.last_progress = time.monotonic()
        self.waiting.append(request)
        self._wake.set()
        return request

    def wake(self) -> None:
        """Runs the loop now (e.g. a replica joined, so target-only orphans can switch back)."""
        self._wake.set()

    def cancel(self, request: ActiveRequest) -> None:
        """Called when the client goes away; the loop releases the request's KV at its next step."""
        if not request.finished:
            request.cancelled = True
            self._wake.set()

    async def run(self) -> None:
        while True:
            self.last_progress = time.monotonic()
            if not self.waiting and not self.running:
                retry = self.releases.owed or self.target_failure is not None
                try:
                    await asyncio.wait_for(self._wake.wait(), RELEASE_RETRY_S if retry else None)
                except TimeoutError:
                    await self.releases.settle(probe_target=self.target_failure is not None)
                    continue
            self._wake.clear()
            self._drop_cancelled()
            self.placement.return_orphans(self.running.values())
            if self.waiting or self.running:
                await self._step()

    async def _step(self) -> None:
        """One step, in phases: choose each request's k, plan, ask for drafts, run the target, apply and count."""
        started = time.perf_counter()
        self._choose_lengths()
        plan = await self._plan()
        if plan is None:
            return
        drafts, timings = await self.proposer.propose(plan.decode)
        items = self._items(plan, drafts)
        step_started = time.perf_counter()
        outcome = await self._run_target(plan, items)
        if outcome is None:
            return
        times = StepTimes(started, step_started - started, time.perf_counter() - step_started)
        observe_target_cost(self.speculation.costs, items, outcome, bool(plan.chunks), times.target_seconds)
        decoding = {entry.request.request_id for entry in plan.decode}
        # The replica each request had when its item was built: a replica failing while the results are read moves
        # requests, and what the target said about the old replica must not be held against the new one.
        sent_to = {entry.request.request_id: entry.request.replica for entry in plan.entries()}
        for item, result in zip(items, outcome.results, strict=True):
            request = self.running[item.request_id]
            if not self._applied(request, item, result, sent_to[item.request_id]):
                continue
            if item.request_id in decoding:
                count_round(self.speculation, request, item, result, timings.get(request.replica or ""), outcome, times)
            if result.new_tokens:
                request.round += 1
                if not request.cancelled:
                    request.output.emit(result.new_tokens, self.eos_token_ids, result.logprobs)
        self.speculation.costs.observe_scheduling(times.scheduling_seconds())
        if outcome.kv_blocks_free is not None:  # what the target holds beyond this loop's requests (before releases)
            own = sum(self.facts.pool.blocks(request.kv_length) for request in self.running.values())
            self.held_elsewhere = max(0, self.facts.pool.num_blocks - outcome.kv_blocks_free - own)
        self._release_finished([item.request_id for item in items])

    def _choose_lengths(self) -> None:
        """Sets each decoding request's k, pausing speculation first where the batch size drafted nothing a while."""
        batch, decoding = self.placement.pause_speculation(), [r for r in self.running.values() if r.decoding]
        self.judged = batch if self.speculation.paused(batch) else sum(1 for r in decoding if r.wants_speculation)
        asking = [self._asking(request) for request in decoding]
        choice = self.speculation.choose(self.judged, asking)
        for request in decoding:
            request.draft_length = choice.lengths[request.request_id]
            request.settled_length = choice.settled[request.request_id]
        self.k_in_use = max((choice.lengths[a.key] for a in asking if a.cap), default=self.k_in_use)

    async def _plan(self) -> StepPlan | None:
        """Chooses the step's requests (orchestrator.loop.batching), preempts and admits; None when nothing fits."""
        plan = plan_step(list(self.running.values()), self.waiting, self.facts.pool, self.settings, self.held_elsewhere)
        if plan.preempted:
            LOG.info("KV pool full: preempting %d requests (newest first)", len(plan.preempted))
            await self._preempt(plan.preempted)
        for request in plan.admitted:
            self.waiting.remove(request)
            self.running[request.request_id] = request
            request.output.mark_scheduled()
        if plan.decode or plan.chunks or plan.preempted:  # the step frees the preempted requests' KV on the target
            return plan
        if self.running or self.waiting:
            # Nothing fits until requests finish: others' (another orchestrator of the target holds blocks; the next
            # step that runs tells how many it still holds), or this loop's, waiting for KV room when the mirror and
            # the target disagree. Yield instead of spinning.
            await asyncio.sleep(0.05 if self.held_elsewhere else 0.01)
            self.held_elsewhere = 0
        return None

    async def _run_target(self, plan: StepPlan, items: list[StepItem]) -> StepOutcome | None:
        """The target's step; None when the call failed: every request starts over once a target answers
        (orchestrator.peers.recovery), or the step's requests fail when the call itself was wrong."""
        try:
            outcome = await self.target.step(items, [request.request_id for request in plan.preempted])
        except BackendError as error:
            scheduled = [entry.request for entry in plan.entries()]
            if error.kind is FailureKind.UNAVAILABLE:
                # The step may have run on the target (a timed-out call, a lost answer): its requests count as held.
                for request in scheduled:
                    request.held()
                await self._start_over(str(error))
            else:
                self._fail(scheduled, RequestFailed(error.kind, str(error)))
            return None
        self.target_failure = None
        return outcome

    async def _start_over(self, cause: str) -> None:
        """Waits for a target that holds none of the requests, then queues every request to be reopened on it from
        its committed tokens; fails them all when none answers within --target-wait."""
        self.target_failure = cause
        running, requests = list(self.running.values()), list(self._requests())
        LOG.warning("the target failed (%s): %d requests wait for a target to start over on", cause, len(requests))
        try:
            await reach_target(self.target, [r.request_id for r in requests if r.opened], cause, self.settings)
        except TargetGone as gone:
            self.waiting.clear()
            self._fail(requests, RequestFailed(FailureKind.UNAVAILABLE, str(gone)))
            return
        self.target_failure = None
        for request in requests:
            request.on_target = OnTarget.NOTHING  # its next item reopens it with every committed token
        await self._preempt(running[::-1])

    def _applied(self, request: ActiveRequest, item: StepItem, result: StepResult, sent_to: str | None) -> bool:
        """Takes what the target did with the request's item into its state; False: it failed or waits for room."""
        if result.failure is not None:
            if result.failure.kind == FailureKind.EXHAUSTED:
                LOG.info("request %s waits for KV room: %s", request.request_id, result.failure)
            else:
                self._fail([request], RequestFailed(result.failure.kind, str(result.failure)))
            return False
        request.held()
        if item.move and request.replica == sent_to:
            request.on_target = OnTarget.OPEN
        request.took_cached(result.cached_tokens)
        # The target keeps KV for the computed tokens, the accepted drafts and, after a multi-token decode, every new
        # token but the last (1 + accepted new tokens after a verification, n after n forward passes).
        request.kv_length += item.num_tokens + max(result.accepted, len(result.new_tokens) - 1)
        if item.replica is not None and not result.streaming:  # the replica the rows went to has no stream
            self.placement.replica_failed(item.replica, "not subscribed to the target")
        return True

    def _items(self, plan: StepPlan, drafts: Drafts) -> list[StepItem]:
        ahead = sum(1 for entry in plan.entries() if self._drafts_next(entry)) <= self.settings.draft_ahead
        return [self._task(entry, drafts.get(entry.request.request_id, DraftTree()), ahead) for entry in plan.entries()]

    def _task(self, entry: PlannedItem, drafts: DraftTree, ahead: bool) -> StepItem:
        request = entry.request
        params = request.params
        rows_to = self._hidden_rows_to(request.replica)
        return StepItem(
            request_id=request.request_id,
            round=request.round + 1,
            num_tokens=entry.num_tokens,
            drafts=drafts,
            open=None if request.opened else self._opening(request),
            replica=rows_to,
            move=request.needs_move,
            replay=request.needs_move and rows_to is not None,
            top_logprobs=params.top_logprobs,
            decode_steps=entry.decode_steps,
            draft_ahead=self._draft_ahead(entry, rows_to) if ahead else 0,
        )

    def _opening(self, request: ActiveRequest) -> OpenRequest:
        params, generated, ends = request.params, tuple(request.output.generated), self._end_tokens(request.params)
        return OpenRequest(params.input_ids, params.sampling, ends, generated, params.cache_salt, params.images)

    def _draft_ahead(self, entry: PlannedItem, rows_to: str | None) -> int:
        """Steps the request's replica may draft for its next round once this step's rows reach it: the k the next
        round most likely asks for (the settled one, not an exploration's: a paused batch's probe drafted ahead 5
        steps for a round of k = 0), within what the request may still generate after at least one more token; 0
        when it is not drafting (target-only, a move, its last round)."""
        request = entry.request
        if not self._drafts_next(entry) or rows_to is None or request.needs_move:
            return 0
        k = self.speculation.expected(self._asking(request), max(1, self.judged))
        return max(0, min(k, request.output.remaining - 2))

    def _asking(self, r: ActiveRequest) -> Asking:
        exempt = r.output.remaining <= 1  # its last token: one longer step at most
        kind, cap = request_class(r.params.sampling), r.max_drafts(self.settings.num_steps)
        return Asking(r.request_id, kind, r.acceptance, cap, r.settled_length, exempt)

    def _drafts_next(self, entry: PlannedItem) -> bool:
        """Whether the request drafts in its round after this step: it verifies drafts in this one, or this is the
        last chunk of its prompt (the step commits its first token) and it has a replica to draft with, which then
        drafts the first round as the rows arrive, with the step's other requests. Not the last chunk of a recompute
        after preemption: its replica was told to forget the request and drafts nothing ahead until asked again."""
        request = entry.request
        if request.decoding:
            return entry.max_drafts > 0
        first_last_chunk = not request.output.generated and entry.num_tokens == request.uncomputed
        return first_last_chunk and self.speculation.expected(self._asking(request), self.judged + 1) > 0

    def _end_tokens(self, params: ValidatedRequest) -> frozenset[int]:
        """The tokens that end a request (RequestOutput stops on the same): a multi-token decode stops there."""
        return params.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)

    def _hidden_rows_to(self, replica_id: str | None) -> str | None:
        """Where the target sends a request's hidden rows: its replica, unless that replica drafts from tokens alone
        (then the target captures nothing for the request)."""
        replica = self.replicas.get(replica_id)
        return None if replica is not None and not replica.hidden_rows else replica_id

    async def _preempt(self, requests: Sequence[ActiveRequest]) -> None:
        """Frees the KV of running requests (newest first) on their drafts now (the target frees it with the step,
        or holds none) and queues them first; they are recomputed from their tokens when they are admitted again."""
        for request in requests:
            del self.running[request.request_id]
            request.kv_length = 0
            # The replica starts over from the recomputed rows. A pending move stays: the target sends the rows where
            # the last move told it to until a move says otherwise; with no KV it replays nothing.
            if request.drafting is Drafting.DRAFTING:  # its replica forgets it and ingests it anew
                request.drafting = Drafting.JOINING
        await self.releases.release_on_replicas(requests)
        self.waiting.extendleft(requests)  # newest first in `requests`: the oldest ends up at the front

    def _requests(self) -> Iterator[ActiveRequest]:
        """Every request not yet released: running ones, then waiting ones."""
        yield from self.running.values()
        yield from self.waiting

    def _target_answered(self, failure: str | None) -> None:
        self.target_failure = failure

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self.running[request.request_id] = request  # released below like a running one
        cancelled = [r for r in self.running.values() if r.cancelled]
        for request in cancelled:
            request.output.finished = True
        self._release_finished([r.request_id for r in cancelled])

    def _release_finished(self, request_ids: Sequence[str]) -> None:
        """Drops finished requests from the running set and starts their releases on target and replicas."""
        finished = [self.running[i] for i in request_ids if i in self.running and self.running[i].finished]
        for request in finished:
            del self.running[request.request_id]
        if not finished:
            return
        # A finished request stops counting against its replica now, not once the releases are answered; the KV
        # mirror counts its blocks free now (should a step reach the target first, an item without room waits).
        for request in finished:
            self.placement.finished(request)
        self.releases.release(finished)

    def unhealthy(self, now: float) -> str | None:
        """Why the orchestrator cannot serve now (grpc.health.v1 reports NOT_SERVING), or None when it can: the
        target failed its last call, or the loop has work and made no step for `settings.stall_s`."""
        if self.target_failure is not None:
            return f"the target does not answer: {self.target_failure}"
        stalled = now - self.last_progress
        if (self.running or self.waiting) and stalled > self.settings.stall_s:
            return f"no step for {stalled:.0f} s with {len(self.running)} running, {len(self.waiting)} waiting"
        return None

    def _fail(self, requests: Sequence[ActiveRequest], failure: RequestFailed) -> None:
        LOG.error("%d requests failed: %s", len(requests), failure)
        for request in requests:
            request.output.fail(failure)
            self.running.setdefault(request.request_id, request)
        self._release_finished([r.request_id for r in requests])
