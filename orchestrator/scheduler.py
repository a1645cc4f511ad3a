"""Rounds over the running batch: admit (prefill), then draft, verify, emit, release.

Round numbers join the draft's two inputs: prefill publishes the target's rows under round 0; a
request in round r asks its draft to propose from round r's rows, and the verification publishes the
next rows under round r + 1.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc
from transformers import PreTrainedTokenizerBase

from orchestrator.replicas import ReplicaPool
from orchestrator.settings import SchedulerSettings
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.validation import ValidatedRequest
from tandem.wire import common_pb2, draft_pb2, orchestrator_pb2, target_pb2, target_pb2_grpc

LOG = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that cannot go on; carries the gRPC status to report to its client."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class ActiveRequest:
    request_id: str
    params: ValidatedRequest
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    replica: str | None  # None: target-only decoding
    outputs: asyncio.Queue[orchestrator_pb2.GenerateResponse | RequestFailed] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    round: int = 0
    stats: Stats = field(default_factory=Stats)
    finished: bool = False
    cancelled: bool = False

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.generated)


class Scheduler:
    def __init__(
        self,
        target: target_pb2_grpc.TargetStub,
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

    def cancel(self, request: ActiveRequest) -> None:
        """Called when the client goes away; the loop releases the request's KV at its next step."""
        if not request.finished:
            request.cancelled = True
            self._wake.set()

    async def run(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
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
        items = [
            target_pb2.PrefillItem(
                request_id=request.request_id,
                input_ids=request.params.input_ids,
                draft_replica=request.replica or "",
                sampling=_sampling_message(request.params),
            )
            for request in batch
        ]
        try:
            response = await self.target.Prefill(target_pb2.PrefillRequest(items=items))
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.running:
                self.waiting.extendleft(reversed(batch))  # retry once running requests free KV blocks
                return
            await self._fail(batch, RequestFailed(error.code(), f"target prefill failed: {error.details()}"))
            return
        for request, result in zip(batch, response.results, strict=True):
            self.running[request.request_id] = request
            self._emit(request, [result.next_token])
        await self._release_finished(batch)

    async def _round(self) -> None:
        requests = list(self.running.values())
        drafts = await self._propose([r for r in requests if r.replica is not None])
        items = []
        for request in requests:
            draft = drafts.get(request.request_id, [])
            items.append(
                target_pb2.VerifyItem(request_id=request.request_id, draft_tokens=draft, round=request.round + 1)
            )
        try:
            response = await self.target.Verify(target_pb2.VerifyRequest(items=items))
        except grpc.aio.AioRpcError as error:
            await self._fail(requests, RequestFailed(error.code(), f"target verify failed: {error.details()}"))
            return
        for request, item, result in zip(requests, items, response.results, strict=True):
            request.round += 1
            request.stats.rounds += 1
            request.stats.draft_tokens += len(item.draft_tokens)
            request.stats.accepted_tokens += result.accepted
            if not request.cancelled:
                self._emit(request, list(result.new_tokens))
        await self._release_finished(requests)

    async def _propose(self, requests: Sequence[ActiveRequest]) -> dict[str, list[int]]:
        """Asks each replica for its requests' drafts, all replicas concurrently."""
        by_replica: dict[str, list[draft_pb2.ProposeItem]] = {}
        for request in requests:
            # A round yields up to k + 1 tokens; never draft past max_new_tokens.
            num_steps = min(self.settings.num_steps, request.remaining - 1)
            if num_steps > 0 and request.replica is not None:
                item = draft_pb2.ProposeItem(request_id=request.request_id, round=request.round, num_steps=num_steps)
                by_replica.setdefault(request.replica, []).append(item)
        replies = await asyncio.gather(
            *(
                self.replicas.stub(replica).Propose(draft_pb2.ProposeRequest(items=items))
                for replica, items in by_replica.items()
            ),
            return_exceptions=True,
        )
        drafts: dict[str, list[int]] = {}
        for (replica, items), reply in zip(by_replica.items(), replies, strict=True):
            if isinstance(reply, BaseException):
                LOG.warning(
                    "draft replica %s failed (%s): its %d requests continue target-only", replica, reply, len(items)
                )
                for item in items:
                    self._to_target_only(self.running[item.request_id])
                continue
            for result in reply.results:
                drafts[result.request_id] = list(result.draft_tokens)
        return drafts

    def _emit(self, request: ActiveRequest, new_tokens: list[int]) -> None:
        """Applies the stop conditions to a request's new tokens and queues one response message."""
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
        response = orchestrator_pb2.GenerateResponse(token_ids=accepted, text=text, finish_reason=finish_reason)
        if finish_reason:
            request.finished = True
            response.stats.CopyFrom(
                orchestrator_pb2.GenerateStats(
                    rounds=request.stats.rounds,
                    draft_tokens=request.stats.draft_tokens,
                    accepted_tokens=request.stats.accepted_tokens,
                    prompt_tokens=len(request.params.input_ids),
                    completion_tokens=len(request.generated),
                )
            )
        request.outputs.put_nowait(response)

    def _to_target_only(self, request: ActiveRequest) -> None:
        if request.replica is not None:
            self.replicas.release(request.replica)
            request.replica = None

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
        calls = [self.target.Release(target_pb2.ReleaseRequest(request_ids=[r.request_id for r in done]))]
        calls += [
            self.replicas.stub(replica).Release(draft_pb2.DraftReleaseRequest(request_ids=ids))
            for replica, ids in by_replica.items()
        ]
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


def _sampling_message(params: ValidatedRequest) -> common_pb2.SamplingParams:
    sampling = params.sampling
    return common_pb2.SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed or 0
    )
