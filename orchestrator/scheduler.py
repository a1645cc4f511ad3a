"""The scheduler loop: one target step after another, each chosen by orchestrator.batching.

A step: free cancelled requests; choose the step (decoding requests first, preempting the newest when the KV pool
is short, then prompt chunks); ask each replica for its decoding requests' drafts; run the step on the target;
emit each request's new tokens (orchestrator.output); release finished requests.

Round numbers join the draft's two inputs: every item a request sends publishes its hidden rows under round + 1,
and the item that commits new tokens moves the request to that round; the draft proposes for round r from the
rows published under r (the chunks of a long prompt, and a replay with the rows after it, arrive as several
messages of one round and are joined by the draft). The scheduler talks to TargetBackend / DraftBackend
(orchestrator/backends.py), so the same steps run against gRPC services or in-process runners.

Failures stay with the request they belong to: an item the target refuses fails that request alone; an item that
finds no KV room waits for the next step; a replica that fails, times out or proposes bad tokens is demoted (its
requests move to another replica or go on target-only) and probed again with backoff until it answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from orchestrator.backends import (
    BackendError,
    FailureKind,
    OpenTask,
    ProposedBatch,
    ProposeTask,
    StepOutcome,
    StepTask,
    TargetBackend,
)
from orchestrator.batching import ActiveRequest, KVPool, Scheduled, draft_rows, plan_step
from orchestrator.output import RequestFailed, RequestOutput
from orchestrator.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings
from orchestrator.speculation import SpeculationPolicy
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.validation import InvalidRequest, ValidatedRequest, with_stop_masking
from tandem.background import in_background

LOG = logging.getLogger(__name__)
MAX_REPROBE_S = 30.0
RELEASE_RETRY_S = 1.0  # how often releases that failed (a peer that did not answer) are tried again
TARGET = ""  # the key of the target among the places a release may be owed to; replicas go by their ids


class QueueFull(Exception):
    """The waiting queue holds its maximum; the message says how many."""


@dataclass(frozen=True)
class TargetFacts:
    """What the scheduler needs to know of the target."""

    vocab_size: int
    pool: KVPool
    max_draft_tokens: int


@dataclass(frozen=True)
class ReplicaTiming:
    call_seconds: float  # wall time of the Propose call
    compute_seconds: float  # of which the replica computed
    ahead_seconds: float = 0.0  # draft compute for the call done before it (drafted ahead)


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
        self.replica_failures = 0  # demotions since start (metrics)
        self.requests_moved = 0  # requests moved off a demoted replica since start (metrics)
        self.requests_paused = 0  # requests taken off their replica by adaptive k at 0 since start (metrics)
        self.speculation = SpeculationPolicy(settings.num_steps, settings.adaptive_k)
        self.k_in_use = settings.num_steps  # the last step's k (metrics)
        # Called with (replica id, seconds) after every Propose call that answered (orchestrator.metrics).
        self.propose_listeners: list[Callable[[str, float], None]] = []
        self._wake = asyncio.Event()
        self._probes: dict[str, asyncio.Task[None]] = {}
        # Releases that failed, by where they are owed (TARGET or a replica id): tried again with the next release
        # there, or after RELEASE_RETRY_S, so that a peer that was slow or stopped for a while gets its KV back.
        self._owed: dict[str, set[str]] = {}

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
        replica = None if params.disable_speculation else self._assign()
        output = RequestOutput(
            prompt_tokens=len(params.input_ids),
            max_new_tokens=params.max_new_tokens,
            ignore_eos=params.ignore_eos,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.input_ids),
            stop=StopStringMatcher(params.stop),
            stop_token_ids=params.stop_token_ids,
        )
        request = ActiveRequest(uuid.uuid4().hex, params, output, replica)
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
                retry = self._owed or self.target_failure is not None
                try:
                    await asyncio.wait_for(self._wake.wait(), RELEASE_RETRY_S if retry else None)
                except TimeoutError:
                    await self._settle_owed()
                    continue
            self._wake.clear()
            self._drop_cancelled()
            self._return_orphans()
            if self.waiting or self.running:
                await self._step()

    async def _step(self) -> None:
        started = time.perf_counter()
        batch = self._pause_speculation()
        # Paused requests count: they share the steps, and k is chosen for the batch the verification rows join. While
        # the batch is paused, the probe drafts as that batch size says (one round in EXPLORE_EVERY), also while the
        # batch fills and few of its requests decode yet.
        speculating = sum(1 for r in self.running.values() if r.decoding and r.wants_speculation)
        judged = batch if self.speculation.paused(batch) else speculating
        self.k_in_use = self.speculation.choose(judged)
        plan = plan_step(list(self.running.values()), self.waiting, self.facts.pool, self.settings, self.k_in_use)
        await self._preempt(plan.preempted)
        for request in plan.admitted:
            self.waiting.remove(request)
            self.running[request.request_id] = request
            request.output.mark_scheduled()
        if not plan.decode and not plan.chunks:
            if self.running or self.waiting:
                # Nothing fits until running requests finish; they are all waiting for KV room, which only
                # happens when the mirror and the target disagree. Yield instead of spinning.
                await asyncio.sleep(0.01)
            return
        pushed = {entry.request.request_id for entry in plan.decode if self._takes_pushed(entry)}
        asked = [entry for entry in plan.decode if entry.request.request_id not in pushed]
        drafts, timings = await self._propose(asked)
        drafting = sum(1 for entry in (*plan.decode, *plan.chunks) if self._drafts_next(entry))
        # What a replica drafts ahead is for the round after this one, which drafts the settled k, not an
        # exploration's (a paused batch's probe drafted ahead 5 steps for a round of k = 0); nothing when the step
        # has more drafting requests than settings.draft_ahead.
        ahead_k = min(self.k_in_use, self.speculation.settled(judged)) if drafting <= self.settings.draft_ahead else 0
        tasks = [
            self._task(entry, drafts.get(entry.request.request_id), ahead_k, entry.request.request_id in pushed)
            for entry in (*plan.decode, *plan.chunks)
        ]
        # The replica each request had when its item was built: a replica failing while the results are read moves
        # requests, and what the target said about the old replica must not be held against the new one.
        sent_to = {entry.request.request_id: entry.request.replica for entry in (*plan.decode, *plan.chunks)}
        step_started = time.perf_counter()
        try:
            outcome = await self.target.step(tasks, [request.request_id for request in plan.preempted])
        except BackendError as error:
            scheduled = [entry.request for entry in (*plan.decode, *plan.chunks)]
            if error.kind is FailureKind.UNAVAILABLE:
                self.target_failure = str(error)
                # The step may still run on the target once it answers again (a timed-out call): release every
                # request of it there, opened or not (releasing an id the target does not hold does nothing).
                for request in scheduled:
                    request.opened = True
            self._fail(scheduled, RequestFailed(error.kind, str(error)))
            return
        self.target_failure = None
        step_call = time.perf_counter() - step_started
        pushed_wait = outcome.pushed_wait_seconds
        propose_call = step_started - started
        # A multi-token decode ran one forward pass per token: the cost model is of one pass.
        passes = max(
            (len(done.new_tokens) for task, done in zip(tasks, outcome.results, strict=True) if task.decode_steps > 1),
            default=1,
        )
        # A paused batch's passes beside its probe's verification (batching._multi_step): the first pass computed
        # more than the others, so the step is no sample of one pass of its size.
        mixed = passes > 1 and any(task.draft_tokens or task.pushed_drafts for task in tasks)
        if not plan.chunks and not mixed:
            # The cost line models decoding steps, which k is chosen for: a step with prompt chunks computes hundreds
            # of tokens at a cost per token (attention over the prompt) that says nothing about a few more rows to
            # verify, and fitted in, it made drafts look dear at 8 requests (docs/architecture.md, adaptive k).
            verified = sum(len(done.pushed.tokens) for done in outcome.results if done.pushed is not None)
            self.speculation.observe_target(
                sum(task.num_tokens + len(task.draft_tokens) for task in tasks) + verified,
                (step_call - pushed_wait) / passes,
            )
        decoding = {entry.request.request_id for entry in plan.decode}
        self._observe_pushed(tasks, outcome)
        for task, done in zip(tasks, outcome.results, strict=True):
            request = self.running[task.request_id]
            if done.failure is not None:
                if done.failure.kind == FailureKind.EXHAUSTED:
                    LOG.info("request %s waits for KV room: %s", request.request_id, done.failure)
                    continue
                self._fail([request], RequestFailed(done.failure.kind, str(done.failure)))
                continue
            request.opened = True
            if task.move and request.replica == sent_to[task.request_id]:
                request.needs_move = False
            if done.pushed is not None and done.pushed.failure is not None:
                self._push_failed(request, sent_to[task.request_id], done.pushed.failure)
            draft_tokens, draft_parents = task.draft_tokens, task.draft_parents
            if done.pushed is not None:
                draft_tokens, draft_parents = done.pushed.tokens, done.pushed.parents
            # The target keeps KV for the computed tokens, the accepted drafts and, after a multi-token decode, every
            # new token but the last (1 + accepted new tokens after a verification, n after n forward passes).
            request.kv_length += task.num_tokens + max(done.accepted, len(done.new_tokens) - 1)
            if task.replica is not None and not done.streaming:  # the replica the rows went to has no stream
                self._replica_failed(task.replica, "not subscribed to the target")
            if task.request_id in decoding:
                stats = request.output.stats
                depth = draft_depth(draft_tokens, draft_parents)
                stats.count_round(len(draft_tokens), depth, done.accepted)
                self.speculation.observe_round(depth, done.accepted)
                timing = timings.get(request.replica or "")
                if done.pushed is not None:
                    # The step waited on the target for the drafts; what of their compute it did not wait for ran
                    # while the target's answer and this step travelled.
                    waited = min(pushed_wait, done.pushed.compute_seconds)
                    timing = ReplicaTiming(waited, waited, done.pushed.compute_seconds - waited)
                draft_compute = timing.compute_seconds if timing else 0.0
                stats.draft_seconds += draft_compute
                stats.draft_ahead_seconds += timing.ahead_seconds if timing else 0.0
                stats.verify_seconds += outcome.compute_seconds
                stats.wire_seconds += (timing.call_seconds - draft_compute if timing else 0.0) + (
                    step_call - outcome.compute_seconds - pushed_wait
                )
                stats.scheduling_seconds += (time.perf_counter() - started) - propose_call - step_call
            if done.new_tokens:
                request.round += 1
                pushes = task.push_drafts and task.draft_ahead > 0 and not request.needs_move
                request.pushed_round = request.round if pushes else None
                if not request.cancelled:
                    request.output.emit(done.new_tokens, self.eos_token_ids, done.logprobs)
        self.speculation.observe_scheduling((time.perf_counter() - started) - propose_call - step_call)
        self._release_finished([task.request_id for task in tasks])

    def _observe_pushed(self, tasks: Sequence[StepTask], outcome: StepOutcome) -> None:
        """Feeds the cost model the pushed drafts of a step as one Propose: the round waited `pushed_wait_seconds`
        for them, of which at most their compute was drafting. A request's first pushed round (drafted after its
        prompt's last chunk, or after it started over) ingested every row of its context, as its first Propose
        would have: those rows are kept apart as in a Propose."""
        pushed = [(task, done.pushed) for task, done in zip(tasks, outcome.results, strict=True) if done.pushed]
        if pushed:
            wait = outcome.pushed_wait_seconds
            compute = max(done.compute_seconds for _, done in pushed)
            k = max(task.pushed_drafts for task, _ in pushed)
            new_rows = 0
            for task, done in pushed:
                request = self.running[task.request_id]
                if done.failure is None and not request.ingested:
                    new_rows += request.kv_length  # the rows it was drafted from: the target's KV before this step
                    request.ingested = True
            self.speculation.observe_propose(len(pushed), k, wait, min(wait, compute), new_rows)

    def _takes_pushed(self, entry: Scheduled) -> bool:
        """Whether the request's drafts for this round are the ones its replica pushed to the target."""
        request = entry.request
        return entry.max_drafts > 0 and request.pushed_round == request.round and not request.needs_move

    def _push_failed(self, request: ActiveRequest, replica_id: str | None, failure: BackendError) -> None:
        """A pushed round verified without drafts: the replica dropped the request (no KV room: it starts over from
        a replay) or failed (not in time, malformed drafts): demoted, as a failed Propose demotes it."""
        request.pushed_round = None
        if failure.kind is FailureKind.EXHAUSTED:
            LOG.warning("request %s goes without drafts this round: %s", request.request_id, failure)
            request.start_over(request.replica)
        elif replica_id is not None:
            self._replica_failed(replica_id, str(failure))

    def _task(
        self,
        entry: Scheduled,
        drafts: tuple[list[int], list[int]] | None,  # (tokens, parents)
        ahead_k: int,  # at most this many drafts ahead for the next round (0: none this step)
        pushed: bool,  # the request's replica pushed this round's drafts to the target
    ) -> StepTask:
        request = entry.request
        params = request.params
        rows_to = self._hidden_rows_to(request.replica)
        draft_ahead = self._draft_ahead(entry, rows_to, ahead_k)
        return StepTask(
            request_id=request.request_id,
            round=request.round + 1,
            num_tokens=entry.num_tokens,
            draft_tokens=drafts[0] if drafts else (),
            draft_parents=drafts[1] if drafts else (),
            open=None if request.opened else OpenTask(params.input_ids, params.sampling, self._end_tokens(params)),
            replica=rows_to,
            move=request.needs_move,
            replay=request.needs_move and rows_to is not None,
            top_logprobs=params.top_logprobs,
            decode_steps=entry.decode_steps,
            draft_ahead=draft_ahead,
            push_drafts=draft_ahead > 0 and self._pushes(request.replica),
            # A chain of at most k; a tree as deep as k, with the nodes the step made room for.
            pushed_drafts=draft_rows(entry.max_drafts, self.settings) if pushed else 0,
            pushed_depth=entry.max_drafts if pushed else 0,
        )

    def _pushes(self, replica_id: str | None) -> bool:
        replica = self.replicas.get(replica_id)
        return replica is not None and replica.backend.pushes

    def _draft_ahead(self, entry: Scheduled, rows_to: str | None, ahead_k: int) -> int:
        """Steps the request's replica may draft for its next round once this step's rows reach it: `ahead_k`,
        within what the request may still generate after at least one more token; 0 when it is not drafting
        (target-only, a move, its last round)."""
        request = entry.request
        if ahead_k == 0 or not self._drafts_next(entry) or rows_to is None or request.needs_move:
            return 0
        return max(0, min(ahead_k, request.output.remaining - 2))

    def _drafts_next(self, entry: Scheduled) -> bool:
        """Whether the request drafts in its round after this step: it verifies drafts in this one, or this is the
        last chunk of its prompt (the step commits its first token) and it has a replica to draft with. That replica
        then ingests the prompt's rows and drafts the first round when they arrive, in one batch with the step's
        other requests, rather than in a Propose the next step waits for. Not the last chunk of a recomputation
        after preemption: its replica was told to forget the request and drafts nothing ahead for it until a
        Propose asks again."""
        request = entry.request
        if request.decoding:
            return entry.max_drafts > 0
        first_prefill = not request.output.generated
        return first_prefill and entry.num_tokens == request.uncomputed and request.max_drafts(self.k_in_use) > 0

    def _end_tokens(self, params: ValidatedRequest) -> frozenset[int]:
        """The tokens that end a request (RequestOutput stops on the same): a multi-token decode stops there."""
        return params.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)

    def _hidden_rows_to(self, replica_id: str | None) -> str | None:
        """Where the target sends a request's hidden rows: its replica, unless that replica drafts from tokens alone
        (then the target captures nothing for the request)."""
        replica = self.replicas.get(replica_id)
        return None if replica is not None and not replica.hidden_rows else replica_id

    async def _preempt(self, requests: Sequence[ActiveRequest]) -> None:
        """Frees the KV of preempted requests on their drafts now (the target frees it with the step) and queues
        them first; they are recomputed from their tokens when they are admitted again."""
        if not requests:
            return
        LOG.info("KV pool full: preempting %d requests (newest first)", len(requests))
        for request in requests:
            del self.running[request.request_id]
            request.kv_length = 0
            # The replica starts over from the recomputed rows. A pending move stays: the target still holds the
            # request and sends its rows where the last move told it to (a replica since demoted, or any at all for
            # a paused request) until a move says otherwise; with no KV it replays nothing.
            request.pushed_round = None
            request.ingested = False
        await self._release_on_drafts(requests)
        self.waiting.extendleft(requests)  # newest first in `requests`: the oldest ends up at the front

    async def _propose(
        self, decode: Sequence[Scheduled]
    ) -> tuple[dict[str, tuple[list[int], list[int]]], dict[str, ReplicaTiming]]:
        """Asks each replica for its requests' drafts (tokens, and parents for a tree), all replicas concurrently;
        checks what they send."""
        by_replica: dict[str, list[ProposeTask]] = {}
        for entry in decode:
            request = entry.request
            if entry.max_drafts > 0 and request.replica is not None:
                tokens = (*request.params.input_ids, *request.output.generated)
                task = ProposeTask(request.request_id, request.round, entry.max_drafts, tokens, request.kv_length)
                by_replica.setdefault(request.replica, []).append(task)
        replies = await asyncio.gather(
            *(self._timed_propose(replica, tasks) for replica, tasks in by_replica.items()), return_exceptions=True
        )
        drafts: dict[str, tuple[list[int], list[int]]] = {}
        timings: dict[str, ReplicaTiming] = {}
        for (replica, tasks), reply in zip(by_replica.items(), replies, strict=True):
            if isinstance(reply, BaseException):
                self._replica_failed(replica, str(reply))
                continue
            batch, call_seconds = reply
            fault = self._check_proposals(tasks, batch)
            if fault:
                self._replica_failed(replica, fault)
                continue
            for request_id, reason in batch.exhausted.items():
                LOG.warning("request %s goes without drafts this round: %s", request_id, reason)
                self.running[request_id].start_over(replica)  # the replica dropped its state
            # A request new to the replica (or started over there) had every committed row ingested: that costs
            # once per request, not per draft step, and is kept apart in the cost model.
            new_rows = 0
            for task in tasks:
                request = self.running[task.request_id]
                new_rows += 0 if request.ingested else task.rows_end
                request.ingested = request.ingested or task.request_id in batch.drafts
            drafts.update({key: (tokens, batch.parents.get(key, [])) for key, tokens in batch.drafts.items()})
            timings[replica] = ReplicaTiming(call_seconds, batch.compute_seconds, batch.ahead_seconds)
            for listener in self.propose_listeners:
                listener(replica, call_seconds)
            k = max(task.num_steps for task in tasks)
            self.speculation.observe_propose(len(tasks), k, call_seconds, batch.compute_seconds, new_rows)
        return drafts, timings

    def _check_proposals(self, tasks: Sequence[ProposeTask], batch: ProposedBatch) -> str:
        """What is wrong with a replica's answer ("" if nothing): a replica that sends bad drafts is at fault."""
        for task in tasks:
            if task.request_id in batch.exhausted:
                continue
            tokens = batch.drafts.get(task.request_id)
            if tokens is None:
                return f"no drafts for request {task.request_id}"
            parents = batch.parents.get(task.request_id)
            if parents is None and len(tokens) > task.num_steps:
                return f"{len(tokens)} drafts for request {task.request_id}, {task.num_steps} asked"
            if parents is not None:
                fault = tree_fault(tokens, parents, self.settings.max_tree_drafts)
                if fault:
                    return f"request {task.request_id}: {fault}"
            if any(not 0 <= token < self.facts.vocab_size for token in tokens):
                return f"draft ids outside the vocabulary [0, {self.facts.vocab_size}) for request {task.request_id}"
        return ""

    async def _timed_propose(self, replica: str, tasks: list[ProposeTask]) -> tuple[ProposedBatch, float]:
        started = time.perf_counter()
        batch = await self.replicas.backend(replica).propose(tasks)
        return batch, time.perf_counter() - started

    def _assign(self) -> str | None:
        replica = self.replicas.pick()
        if replica is not None:
            self.replicas.acquire(replica)
        return replica

    def _replica_failed(self, replica_id: str, reason: str) -> None:
        """Demotes a failed replica and moves its requests to another one (or to target-only); it is probed again
        with backoff and serves new requests once it answers."""
        replica = self.replicas.get(replica_id)
        if replica is None or replica.demoted:
            return
        self.replicas.demote(replica_id)
        self.replica_failures += 1
        moved = [r for r in (*self.running.values(), *self.waiting) if r.replica == replica_id]
        self.requests_moved += len(moved)
        LOG.warning("draft replica %s demoted (%s): moving its %d requests", replica_id, reason, len(moved))
        for request in moved:
            self.replicas.release(replica_id)
            request.start_over(self._assign())
        # What the replica still holds of them is of no use now; a live but slow replica frees it.
        in_background(self._forget_on(replica_id, [r.request_id for r in moved]))
        if replica_id not in self._probes:
            self._probes[replica_id] = asyncio.get_running_loop().create_task(self._reprobe(replica_id))

    async def _forget_on(self, replica_id: str, request_ids: list[str]) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None and request_ids:
            try:
                await replica.backend.release(request_ids)
            except BackendError as error:
                LOG.info("replica %s could not release moved requests: %s", replica_id, error)

    async def _reprobe(self, replica_id: str) -> None:
        wait = self.settings.reprobe_s
        try:
            while (replica := self.replicas.get(replica_id)) is not None and replica.demoted:
                await asyncio.sleep(wait)
                try:
                    await replica.backend.probe()
                except BackendError as error:
                    wait = min(2 * wait, MAX_REPROBE_S)
                    LOG.info("draft replica %s still failing (%s); next probe in %.0f s", replica_id, error, wait)
                    continue
                LOG.info("draft replica %s answers again: it serves new requests", replica_id)
                self.replicas.restore(replica_id)
                self._wake.set()
        finally:
            self._probes.pop(replica_id, None)

    def _pause_speculation(self) -> int:
        """When adaptive k has settled at 0 for the batch at hand, takes every request but one off its replica: a
        request at k = 0 still has its hidden rows captured and streamed to the replica each step, so that drafting
        may resume, and that costs what speculation no longer wins back. A paused request decodes target-only
        (several tokens a step) to its end; it is not brought back, since the replica would need every row of its
        context again. The one left, the probe, keeps k measured at this batch size (one round in EXPLORE_EVERY
        drafts in full), so that requests admitted after k rises again speculate. Returns the batch size it judged."""
        # The batch size is every request that wants speculation, paused ones included: they share the steps.
        wanting = [r for r in (*self.running.values(), *self.waiting) if r.wants_speculation and not r.finished]
        batch = min(len(wanting), self.settings.max_num_seqs)
        attached = [request for request in wanting if request.replica is not None]
        if len(attached) < 2 or not self.speculation.paused(batch):
            return batch
        forget: dict[str, list[str]] = {}
        for request in attached[1:]:
            replica = request.replica
            assert replica is not None
            self.replicas.release(replica)
            if request.opened:
                forget.setdefault(replica, []).append(request.request_id)
            request.start_over(None)  # the target stops capturing its rows
            request.paused = True
        self.requests_paused += len(attached) - 1
        LOG.info("adaptive k is 0 at %d requests: %d go on without drafts", len(wanting), len(attached) - 1)
        for replica_id, request_ids in forget.items():
            in_background(self._forget_on(replica_id, request_ids))
        return batch

    def _return_orphans(self) -> None:
        """Brings target-only requests that want speculation back to a replica once one serves (not paused ones)."""
        if not self.replicas.has_serving():
            return
        for request in self.running.values():
            if request.replica is None and request.wants_speculation and not request.finished and not request.paused:
                request.start_over(self._assign())

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
        done = [self.running[i] for i in request_ids if i in self.running and self.running[i].finished]
        if not done:
            return
        for request in done:
            del self.running[request.request_id]
        by_replica = self._by_replica(done)
        # A finished request stops counting against its replica now, not once the releases below are answered.
        for request in done:
            if request.replica is not None:
                self.replicas.release(request.replica)
        opened = [r.request_id for r in done if r.opened]
        # The loop goes on without waiting for the answers (a replica busy drafting ahead answers after its batch,
        # which held every running request about 5 ms per finished one on 2 cores). The KV mirror counts the blocks
        # free now; should a step reach the target before its release, an item without room waits a step.
        in_background(
            asyncio.gather(
                self._release_on(TARGET, opened),
                *(self._release_on(replica, ids) for replica, ids in by_replica.items()),
            )
        )

    async def _release_on_drafts(self, requests: Sequence[ActiveRequest]) -> None:
        by_replica = self._by_replica(requests)
        await asyncio.gather(*(self._release_on(replica, ids) for replica, ids in by_replica.items()))

    def _by_replica(self, requests: Sequence[ActiveRequest]) -> dict[str, list[str]]:
        """The ids of `requests` by the replica (still in the pool) that holds them."""
        by_replica: dict[str, list[str]] = {}
        for request in requests:
            if request.replica is not None and self.replicas.get(request.replica) is not None:
                by_replica.setdefault(request.replica, []).append(request.request_id)
        return by_replica

    async def _release_on(self, where: str, request_ids: Sequence[str], probe: bool = False) -> None:
        """Releases requests on the target (TARGET) or a replica, with what is still owed there; what fails is
        owed again. Releases owed to a replica that left the pool are dropped with it. With `probe`, a release of
        nothing still goes out: it answers once the peer's model thread does."""
        replica = self.replicas.get(where)
        backend = self.target if where == TARGET else replica.backend if replica is not None else None
        owed = [*self._owed.pop(where, ()), *request_ids]
        if backend is None or not (owed or probe):
            return
        try:
            await backend.release(owed)
        except BackendError as error:
            LOG.warning("release of %d requests failed, will retry: %s", len(owed), error)
            self._owed.setdefault(where, set()).update(owed)  # with what another release failed to send meanwhile
            if where == TARGET:
                self.target_failure = str(error)
            return
        if where == TARGET:
            self.target_failure = None

    def unhealthy(self, now: float) -> str | None:
        """Why the orchestrator cannot serve now (grpc.health.v1 reports NOT_SERVING), or None when it can: the
        target failed its last call, or the loop has work and made no step for `settings.stall_s`."""
        if self.target_failure is not None:
            return f"the target does not answer: {self.target_failure}"
        stalled = now - self.last_progress
        if (self.running or self.waiting) and stalled > self.settings.stall_s:
            return f"no step for {stalled:.0f} s with {len(self.running)} running, {len(self.waiting)} waiting"
        return None

    async def _settle_owed(self) -> None:
        """Retries owed releases; after a target failure, probes the target until it answers again."""
        places = set(self._owed) | ({TARGET} if self.target_failure is not None else set())
        await asyncio.gather(*(self._release_on(where, (), probe=where == TARGET) for where in places))

    def _fail(self, requests: Sequence[ActiveRequest], failure: RequestFailed) -> None:
        LOG.error("%d requests failed: %s", len(requests), failure)
        for request in requests:
            request.output.fail(failure)
            self.running.setdefault(request.request_id, request)
        self._release_finished([r.request_id for r in requests])


def draft_depth(tokens: Sequence[int], parents: Sequence[int]) -> int:
    """How many tokens a round's drafts can add at most: a chain's length, a tree's depth (parents checked)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return max(depths, default=0) if parents else len(tokens)


def tree_fault(tokens: Sequence[int], parents: Sequence[int], max_drafts: int) -> str:
    """What is wrong with a replica's tree ("" if nothing): one parent per token, each -1 or an earlier index, and at
    most --speculative-num-draft-tokens - 1 tokens."""
    if len(tokens) > max_drafts:
        return f"a tree of {len(tokens)} drafts, --speculative-num-draft-tokens allows {max_drafts}"
    if len(parents) != len(tokens):
        return f"{len(parents)} draft parents for {len(tokens)} drafts"
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            return f"draft parent {parent} of draft {index}: must be -1 or an earlier draft's index"
    return ""
