"""Rounds over the running batch: admit (prefill), then draft, verify, emit, release.

Round numbers join the draft's two inputs: prefill publishes the target's rows under round 0; a
request in round r asks its draft to propose from round r's rows, and the verification publishes the
next rows under round r + 1. The scheduler talks to TargetBackend / DraftBackend (orchestrator/
backends.py), so the same rounds run against gRPC services or in-process runners.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from orchestrator.backends import (
    BackendError,
    FailureKind,
    PrefillTask,
    ProposedBatch,
    ProposeTask,
    ReassignTask,
    TargetBackend,
    VerifyTask,
)
from orchestrator.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.validation import ValidatedRequest

LOG = logging.getLogger(__name__)


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
class ActiveRequest:
    request_id: str
    params: ValidatedRequest
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    replica: str | None  # None: target-only decoding
    outputs: asyncio.Queue[Output | RequestFailed] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    round: int = 0
    stats: Stats = field(default_factory=Stats)
    finished: bool = False
    cancelled: bool = False
    # The target must (re)send this request's history to its replica (or stop streaming, replica None)
    # before the replica can propose for it: set when a replica is lost or the request switches back.
    needs_replay: bool = False

    @property
    def wants_speculation(self) -> bool:
        return not self.params.disable_speculation

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)


@dataclass(frozen=True)
class ReplicaTiming:
    call_seconds: float  # wall time of the Propose call
    compute_seconds: float  # of which the replica computed


class Scheduler:
    def __init__(
        self,
        target: TargetBackend,
        replicas: ReplicaPool,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int],
        settings: SchedulerSettings,
    ) -> None:
        self.target = target
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.settings = settings
        self.waiting: deque[ActiveRequest] = deque()
        self.running: dict[str, ActiveRequest] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count()

    def submit(self, params: ValidatedRequest) -> ActiveRequest:
        replica = None if params.disable_speculation else self.replicas.pick()
        request = ActiveRequest(
            request_id=f"req-{next(self._ids)}",
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.input_ids),
            stop=StopStringMatcher(params.stop),
            replica=replica,
        )
        if replica is not None:
            self.replicas.acquire(replica)
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
            if not self.waiting and not self.running:
                await self._wake.wait()
            self._wake.clear()
            await self._drop_cancelled()
            await self._admit()
            if self.running:
                await self._round()

    async def _admit(self) -> None:
        batch: list[ActiveRequest] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.settings.max_batch_size:
            request = self.waiting[0]
            if batch and tokens + len(request.params.input_ids) > self.settings.max_prefill_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += len(request.params.input_ids)
        if not batch:
            return
        tasks = [PrefillTask(r.request_id, r.params.input_ids, r.params.sampling, r.replica) for r in batch]
        try:
            prefilled = await self.target.prefill(tasks)
        except BackendError as error:
            if error.kind == FailureKind.EXHAUSTED and self.running:
                self.waiting.extendleft(reversed(batch))  # retry once running requests free KV blocks
                return
            await self._fail(batch, RequestFailed(error.kind, str(error)))
            return
        for request, result in zip(batch, prefilled, strict=True):
            self.running[request.request_id] = request
            self._emit(request, [result.first_token])
        for request, result in zip(batch, prefilled, strict=True):
            if request.replica is not None and not result.streaming:
                self._replica_lost(request.replica, "not subscribed to the target")
        await self._release_finished(batch)
        await self._replay_pending()

    async def _round(self) -> None:
        """draft -> verify -> accept (on the target) -> emit -> release finished."""
        started = time.perf_counter()
        requests = list(self.running.values())
        drafts, replica_timing = await self._propose([r for r in requests if r.replica is not None])
        tasks = [VerifyTask(r.request_id, drafts.get(r.request_id, []), r.round + 1) for r in requests]
        verify_started = time.perf_counter()
        try:
            verified = await self.target.verify(tasks)
        except BackendError as error:
            await self._fail(requests, RequestFailed(error.kind, str(error)))
            return
        verify_call = time.perf_counter() - verify_started
        propose_call = verify_started - started
        for request, task, result in zip(requests, tasks, verified.results, strict=True):
            request.round += 1
            request.stats.count_round(len(task.draft_tokens), result.accepted)
            timing = replica_timing.get(request.replica or "")
            draft_compute = timing.compute_seconds if timing else 0.0
            request.stats.draft_seconds += draft_compute
            request.stats.verify_seconds += verified.compute_seconds
            request.stats.wire_seconds += (timing.call_seconds - draft_compute if timing else 0.0) + (
                verify_call - verified.compute_seconds
            )
            if not request.cancelled:
                self._emit(request, result.new_tokens)
        finished = time.perf_counter()
        for request in requests:
            request.stats.scheduling_seconds += (finished - started) - propose_call - verify_call
        await self._release_finished(requests)
        await self._replay_pending()

    async def _propose(
        self, requests: Sequence[ActiveRequest]
    ) -> tuple[dict[str, list[int]], dict[str, ReplicaTiming]]:
        """Asks each replica for its requests' drafts, all replicas concurrently."""
        by_replica: dict[str, list[ProposeTask]] = {}
        for request in requests:
            # A round yields up to k + 1 tokens; never draft past max_new_tokens.
            num_steps = min(self.settings.num_steps, request.remaining - 1)
            if num_steps > 0 and request.replica is not None and not request.needs_replay:
                task = ProposeTask(request.request_id, request.round, num_steps)
                by_replica.setdefault(request.replica, []).append(task)
        replies = await asyncio.gather(
            *(self._timed_propose(replica, tasks) for replica, tasks in by_replica.items()), return_exceptions=True
        )
        drafts: dict[str, list[int]] = {}
        timings: dict[str, ReplicaTiming] = {}
        for replica, reply in zip(by_replica, replies, strict=True):
            if isinstance(reply, BaseException):
                self._replica_lost(replica, str(reply))
                continue
            batch, call_seconds = reply
            drafts.update(batch.drafts)
            timings[replica] = ReplicaTiming(call_seconds, batch.compute_seconds)
        return drafts, timings

    async def _timed_propose(self, replica: str, tasks: list[ProposeTask]) -> tuple[ProposedBatch, float]:
        started = time.perf_counter()
        batch = await self.replicas.backend(replica).propose(tasks)
        return batch, time.perf_counter() - started

    def _emit(self, request: ActiveRequest, new_tokens: list[int]) -> None:
        """Applies the stop conditions to a request's new tokens and queues one output message."""
        accepted: list[int] = []
        finish_reason = ""
        for token in new_tokens:
            accepted.append(token)
            request.generated.append(token)
            if token in self.eos_token_ids and not request.params.ignore_eos:
                finish_reason = "eos"
                break
            if request.remaining <= 0:
                finish_reason = "length"
                break
        text = request.detokenizer.push(accepted)
        if finish_reason:
            text += request.detokenizer.flush()
        text, stopped = request.stop.feed(text)
        if stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += request.stop.flush()
        request.finished = bool(finish_reason)
        request.outputs.put_nowait(
            Output(
                token_ids=accepted,
                text=text,
                finish_reason=finish_reason,
                stats=request.stats if finish_reason else None,
                prompt_tokens=len(request.params.input_ids),
                completion_tokens=len(request.generated),
            )
        )

    def _replica_lost(self, replica_id: str, reason: str) -> None:
        """Forgets a failed replica and moves its requests to another one (or to target-only).

        Moved running requests need a replay of their history; this round they are verified without drafts.
        """
        if self.replicas.remove(replica_id) is None:
            return
        moved = [r for r in self.running.values() if r.replica == replica_id]
        LOG.warning("draft replica %s lost (%s): moving its %d running requests", replica_id, reason, len(moved))
        for request in self.waiting:
            if request.replica == replica_id:
                request.replica = self._assign()
        for request in moved:
            request.replica = self._assign()
            request.needs_replay = True

    def _assign(self) -> str | None:
        replica = self.replicas.pick()
        if replica is not None:
            self.replicas.acquire(replica)
        return replica

    async def _replay_pending(self) -> None:
        """Sends moved requests' history to their new replica; brings target-only orphans back to speculation."""
        if self.replicas.has_serving():
            for request in self.running.values():
                if request.replica is None and request.wants_speculation and not request.finished:
                    request.replica = self._assign()
                    request.needs_replay = True
        pending = [r for r in self.running.values() if r.needs_replay and not r.finished]
        if not pending:
            return
        tasks = [ReassignTask(r.request_id, r.replica, r.round) for r in pending]
        try:
            streaming = await self.target.reassign(tasks)
        except BackendError as error:
            LOG.warning("reassigning %d requests failed (%s): they go on target-only", len(pending), error)
            streaming = [False] * len(pending)
        for request, ok in zip(pending, streaming, strict=True):
            request.needs_replay = False
            if request.replica is not None and not ok:
                # That replica is gone too: forget it. The request is target-only until the next round's
                # _replay_pending assigns it again (if any replica is left).
                lost = request.replica
                request.replica = None
                self._replica_lost(lost, "not subscribed to the target")

    async def _drop_cancelled(self) -> None:
        cancelled = [r for r in self.running.values() if r.cancelled]
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            if request.replica is not None:
                self.replicas.release(request.replica)
        for request in cancelled:
            request.finished = True
        await self._release_finished(cancelled)

    async def _release_finished(self, requests: Sequence[ActiveRequest]) -> None:
        done = [r for r in requests if r.finished and r.request_id in self.running]
        if not done:
            return
        for request in done:
            del self.running[request.request_id]
        by_replica: dict[str, list[str]] = {}
        for request in done:
            if request.replica is not None:
                by_replica.setdefault(request.replica, []).append(request.request_id)
                self.replicas.release(request.replica)
        calls = [self.target.release([r.request_id for r in done])]
        calls += [self.replicas.backend(replica).release(ids) for replica, ids in by_replica.items()]
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                LOG.warning("release failed: %s", outcome)

    async def _fail(self, requests: Sequence[ActiveRequest], failure: RequestFailed) -> None:
        LOG.error("%d requests failed: %s", len(requests), failure)
        for request in requests:
            request.finished = True
            request.outputs.put_nowait(failure)
            self.running.setdefault(request.request_id, request)
        await self._release_finished(requests)
