"""A draft replica's gRPC service (its start-up against the target: draft_server.startup).

Per round, Propose joins the orchestrator's request with the target's rows for the same (request id, round) and runs
the runner on one worker thread.

Drafting ahead (draft_server.ahead): rows that carry `draft_ahead` (the orchestrator asked for it in the step item)
are drafted as soon as the step's last message (`step_end`) arrives, one batch for the step. Propose then takes the
drafts made ahead (waiting for them if they are still being made) when it asks for the same number of steps, the
first ones of a longer chain, and drafts again from the same rows otherwise. Rows a Propose already waits for are
never drafted ahead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import grpc

from draft_server.ahead import DraftedAhead, Key, drafting_failure, drop_stale, settle, timed_proposals, usable_drafts
from draft_server.proposals import PreparedDraft, ProposalRunner, ingest_final_rows, propose_what_fits
from draft_server.runner import DraftRequestError, ProposeInput, TargetRows, join_rounds, pop_rounds
from draft_server.settings import DraftSettings
from draft_server.shaping import Shapings
from tandem.background import in_background
from tandem.grpc_util import CallFailed
from tandem.leases import Leases, leased_call, leased_stream
from tandem.model_thread import ModelThread
from tandem.sampling.draft_tree import DraftTree
from tandem.wire import draft_pb2, draft_pb2_grpc, target_pb2
from tandem.wire.drafts import tree_to_proto

LOG = logging.getLogger(__name__)
T = TypeVar("T")


class DraftService(draft_pb2_grpc.DraftServicer):
    def __init__(
        self, runner: ProposalRunner, settings: DraftSettings, prepared: PreparedDraft, model_thread: ModelThread
    ) -> None:
        self.runner = runner
        self.prepared = prepared
        self.settings = settings
        self._rows: dict[Key, tuple[TargetRows, float]] = {}
        self._arrived = asyncio.Condition()
        self._ahead_wanted: dict[Key, int] = {}  # rows of this step to draft ahead, and their steps
        self._ahead: dict[Key, tuple[DraftedAhead, float]] = {}  # drafts made (or being made) ahead, arrival time
        self._asked: set[Key] = set()  # rows a Propose is waiting for: never drafted ahead
        self.drafted_ahead = 0  # proposals answered with drafts made ahead (GetInfo)
        # Requests dropped for lack of KV room: this replica holds none of their state until their rows start over
        # (a replay), so rows that continue them are not drafted (a batch with them would fail as a whole).
        self._dropped: set[str] = set()
        # Requests whose state was dropped when the hidden-state stream from the target broke (`lose_all`): their
        # next Propose answers at once that they need a replay, rather than wait for rows lost with the stream.
        self._lost: set[str] = set()
        # Requests released, by when: rows of theirs that arrive after the release (in flight, or overtaken by it)
        # are not drafted ahead, which would hold their KV again. A Propose for one (after a preemption) clears it.
        self._released: dict[str, float] = {}
        # Requests whose options shape drafts (HiddenStates.shaping), with their committed tokens.
        self._shaping = Shapings()
        self.model_thread = model_thread  # every runner call goes through it, one at a time
        self.leases = Leases(settings.cache.orphan_timeout_s)  # which orchestrator session drafts which request
        self.propose_listeners: list[Callable[[float], None]] = []  # called with each Propose's compute seconds
        # Called with the seconds each Propose waited for the target's hidden rows of its requests (see _propose).
        self.rows_wait_listeners: list[Callable[[float], None]] = []

    async def store(self, batch: target_pb2.HiddenBatch) -> None:
        """Stores a batch of the target's rows (draft_server.startup.follow_target), keyed by (request id, round)."""
        async with self._arrived:
            for message in batch.rows:
                self._store(message)
            self._arrived.notify_all()

    def _store(self, message: target_pb2.HiddenStates) -> None:
        """Keeps one message's rows (under the rows' lock), or frees a request the target freed; the step's last
        message starts drafting ahead."""
        if message.released:
            self._release_soon(message.request_id)
            return
        owner = self.leases.owner(message.request_id)
        if owner:
            # The target runs the request, so its orchestrator is alive, though it may not call this replica for a
            # while (and its stream here may have dropped).
            self.leases.seen(owner, time.monotonic())
        self._shaping.note(message)
        rows = TargetRows.of(message)
        key = (message.request_id, message.round)
        earlier = self._rows.get(key)
        if earlier is not None:
            # A later chunk of the same round (chunked prefill, or a replay followed by new rows).
            try:
                rows = earlier[0].followed_by(rows)
            except DraftRequestError as error:
                LOG.warning("request %s round %d: %s; keeping the later rows", *key, error)
        self._rows[key] = (rows, time.monotonic())
        if message.start_position <= 0:  # the request starts over here (its first rows, or a replay)
            self._dropped.discard(message.request_id)
        if message.draft_ahead > 0 and key not in self._asked:
            self._ahead_wanted[key] = message.draft_ahead
        if message.step_end and self._ahead_wanted:
            self._start_ahead(self._ahead_wanted)
            self._ahead_wanted = {}

    def _input(self, request_id: str, rows: TargetRows, num_steps: int) -> ProposeInput:
        """What the runner drafts from for a request: its rows, and its options with the tokens up to them."""
        end = rows.start_position + len(rows.next_tokens)
        return ProposeInput(request_id, rows, num_steps, self._shaping.at(request_id, end))

    def _start_ahead(self, wanted: Mapping[Key, int]) -> None:
        """Takes the rows of `wanted` (key -> steps) and drafts them as one batch on the model thread. Runs under
        the rows' lock, with no await before the batch is queued on the model thread: a Release handled after this
        is queued after the batch, so it frees what the batch drafted."""
        batch: dict[Key, DraftedAhead] = {}
        for key, steps in wanted.items():
            if key in self._asked or key not in self._rows or key[0] in self._released:
                continue
            batch[key] = DraftedAhead(self._pop_rows(*key), steps)
        if not batch:
            return
        now = time.monotonic()
        for key, ahead in batch.items():
            self._ahead[key] = (ahead, now)
        live = {key: ahead for key, ahead in batch.items() if not self._needs_replay(key[0], ahead.rows)}
        for key in batch.keys() - live.keys():
            batch[key].exhausted = "it was dropped for lack of KV room and needs a replay"
            batch[key].done.set_result(None)
        if not live:
            return
        inputs = [self._input(key[0], ahead.rows, ahead.num_steps) for key, ahead in live.items()]
        computing = self.model_thread.start(timed_proposals, self.runner, inputs)
        computing.add_done_callback(lambda done: settle(live, done))

    def _needs_replay(self, request_id: str, rows: TargetRows) -> bool:
        return request_id in self._dropped and rows.start_position > 0

    async def GetInfo(
        self, request: draft_pb2.DraftInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftInfo:
        return draft_pb2.DraftInfo(
            replica_id=self.settings.replica_id,
            architecture=self.prepared.architecture,
            kind=self.prepared.kind,
            num_steps=self.settings.num_steps,
            capture_indices=list(self.prepared.capture.indices),
            running_requests=len(self.runner.requests),
            kv_blocks_total=self.runner.cache.num_blocks,
            kv_blocks_free=self.runner.cache.num_free_blocks,
            drafted_ahead=self.drafted_ahead,
        )

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        return await leased_call(self.leases, context, lambda session: self._propose(request, session))

    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeResponse]:
        async for response in leased_stream(
            self.leases, context, requests, self._propose, lambda error: draft_pb2.ProposeResponse(error=error)
        ):
            yield response

    async def _propose(self, request: draft_pb2.ProposeRequest, session: str) -> draft_pb2.ProposeResponse:
        # The hidden-row lag: from the call's arrival until the rows of all its requests reach their rows_end. The
        # target streams a round's rows when its step ends and the orchestrator proposes only after reading that
        # step's answer, so the rows normally arrive first and this stays near 0; when it does not, the
        # target->draft stream is what the round waits for. Calls that fail while waiting are not timed.
        arrived = time.perf_counter()
        now = time.monotonic()
        for item in request.items:
            # Owned before any of its state is made: a call cut off by its orchestrator's death still leaves the
            # state it made (the drafting runs on) to that orchestrator's session, which frees it.
            self.leases.own(session, item.request_id, now)
        steps = {item.request_id: item.num_steps or self.settings.num_steps for item in request.items}
        ahead, inputs, lost = await self._take_all(request, steps)
        for listener in self.rows_wait_listeners:
            listener(time.perf_counter() - arrived)
        drafts, exhausted, ahead_seconds = await self._from_ahead(ahead, steps, arrived, inputs)
        prefix = {request_id: made.prefix for request_id, made in ahead.items()}
        exhausted.update(dict.fromkeys(lost, "its state was dropped when the target's hidden-state stream broke"))
        ahead_waited = max((made.finished for made in ahead.values()), default=arrived) - arrived
        started = time.perf_counter()
        if inputs:
            try:
                more = await self._run(propose_what_fits, self.runner, inputs)
            except DraftRequestError as error:
                raise CallFailed(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
            drafts.update(more.drafts)
            exhausted.update(more.exhausted)
            prefix.update(more.prefix)
        compute = max(0.0, ahead_waited) + (time.perf_counter() - started if inputs else 0.0)
        response = draft_pb2.ProposeResponse(compute_seconds=compute, ahead_seconds=ahead_seconds)
        for listener in self.propose_listeners:
            listener(response.compute_seconds + response.ahead_seconds)
        for item in request.items:
            asked, cached = prefix.get(item.request_id, (0, 0))
            result = response.results.add(
                request_id=item.request_id, prefix_queried_tokens=asked, prefix_cached_tokens=cached
            )
            if item.request_id in exhausted:
                self._dropped.add(item.request_id)
                result.error.CopyFrom(self._no_room(exhausted[item.request_id]).as_proto())
            else:
                result.drafts.CopyFrom(tree_to_proto(drafts[item.request_id]))
        return response

    async def _take_all(
        self, request: draft_pb2.ProposeRequest, steps: Mapping[str, int]
    ) -> tuple[dict[str, DraftedAhead], list[ProposeInput], set[str]]:
        """Each request's rows for this round, or what was drafted ahead from them; and the requests lost with the
        target's stream (`lose_all`), which have neither."""
        ahead: dict[str, DraftedAhead] = {}
        inputs = []
        lost: set[str] = set()
        for item in request.items:
            self._released.pop(item.request_id, None)  # asked for again (after a preemption): it is live
            try:
                taken = await self._take_rows(item.request_id, item.round, item.rows_end)
            except DraftRequestError as error:
                raise CallFailed(grpc.StatusCode.FAILED_PRECONDITION, f"request {item.request_id!r}: {error}") from None
            if taken is None:
                lost.add(item.request_id)
            elif isinstance(taken, DraftedAhead):
                ahead[item.request_id] = taken
            else:
                inputs.append(self._input(item.request_id, taken, steps[item.request_id]))
        return ahead, inputs, lost

    async def _from_ahead(
        self,
        ahead: Mapping[str, DraftedAhead],
        steps: Mapping[str, int],
        arrived: float,  # perf_counter when the Propose arrived
        inputs: list[ProposeInput],  # gets the requests drafted ahead for another length: drafted again
    ) -> tuple[dict[str, DraftTree], dict[str, str], float]:
        """What the drafts made ahead answer: drafts and exhausted requests by id, and the compute they took before
        the call."""
        drafts: dict[str, DraftTree] = {}
        exhausted: dict[str, str] = {}
        ahead_seconds = 0.0
        for request_id, made in ahead.items():
            await self._drafted(request_id, made)
            # One batch drafted them all: its time before this call, once (as compute_seconds counts a batch once).
            ahead_seconds = max(ahead_seconds, min(made.finished, arrived) - made.started)
            if made.exhausted is not None:
                exhausted[request_id] = made.exhausted
            elif (usable := usable_drafts(made, steps[request_id], self.settings.tree.topk == 1)) is not None:
                drafts[request_id] = usable
                self.drafted_ahead += 1
            else:  # another length than drafted ahead: draft again from the same rows
                inputs.append(self._input(request_id, made.rows, steps[request_id]))
        return drafts, exhausted, ahead_seconds

    async def _drafted(self, request_id: str, made: DraftedAhead) -> None:
        """Waits for a draft-ahead batch; raises CallFailed, as a Propose's own drafting would, when it failed."""
        try:
            await asyncio.wait_for(asyncio.shield(made.done), self.settings.rows_timeout_s)
        except TimeoutError:
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"request {request_id!r}: drafting ahead took more than {self.settings.rows_timeout_s} s",
            ) from None
        except Exception as error:
            raise drafting_failure(request_id, error) from None

    def _no_room(self, reason: str) -> CallFailed:
        """What a request whose state this replica dropped answers (no KV room for it, or its rows were lost with
        the target's stream): the orchestrator replays it."""
        return CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"draft {self.settings.replica_id}: {reason}")

    async def Release(
        self, request: draft_pb2.DraftReleaseRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftReleaseResponse:
        await self._release(set(request.request_ids))
        return draft_pb2.DraftReleaseResponse()

    def _release_soon(self, request_id: str) -> None:
        """Frees a request the target freed (HiddenStates.released), in a task: the stream's next rows go on while
        the model thread finishes what it is drafting."""
        in_background(self._release({request_id}))

    async def lose_all(self) -> int:
        """Drops every request's state after the hidden-state stream from the target broke (rows went missing
        with it); each is answered at its next Propose as needing a replay. Returns how many there were."""
        held = await self._run(lambda: list(self.runner.requests))  # the model thread's own view
        async with self._arrived:
            lost = {*held, *(key[0] for key in self._rows), *(key[0] for key in self._ahead)}
            self._rows.clear()
            self._ahead.clear()
            self._ahead_wanted = {}
            self._shaping.requests.clear()
            self._lost |= lost
            self._dropped |= lost  # rows that continue them are not drafted ahead
            self._arrived.notify_all()  # a Propose waiting for their rows answers now
        await self._run(self.runner.release, list(lost))
        return len(lost)

    async def _release(self, released: set[str]) -> None:
        async with self._arrived:
            final = self._final_rows(released - self._dropped - self._lost)
            now = time.monotonic()
            self._released.update((request_id, now) for request_id in released)
            self._dropped.difference_update(released)
            self._lost.difference_update(released)
            for request_id in released:
                self._shaping.requests.pop(request_id, None)
            for key in [key for key in self._rows if key[0] in released]:
                del self._rows[key]
            for key in [key for key in self._ahead if key[0] in released]:
                del self._ahead[key]
            self._ahead_wanted = {key: steps for key, steps in self._ahead_wanted.items() if key[0] not in released}
        if final:
            await self._run(ingest_final_rows, self.runner, final)
        await self._run(self.runner.release, list(released))
        self.leases.forget(list(released))

    def _final_rows(self, released: set[str]) -> list[ProposeInput]:
        """The rows no Propose took of released requests (their last round's), for a replica with a prefix cache to
        cache their draft context as far as the target's KV goes; under the rows' lock."""
        if self.runner.prefixes is None:
            return []
        rounds: dict[str, int] = {}
        for request_id, number in self._rows:
            if request_id in released:
                rounds[request_id] = max(number, rounds.get(request_id, number))
        return [self._input(request_id, self._pop_rows(request_id, last), 1) for request_id, last in rounds.items()]

    async def sweep(self, interval_s: float) -> None:
        """Every `interval_s`: drops rows nobody asked for and frees the requests of orchestrators that are gone."""
        while True:
            await asyncio.sleep(interval_s)
            async with self._arrived:
                self._drop_stale_rows()
            orphans = self.leases.expired(time.monotonic())
            if orphans:
                LOG.warning("freeing %d requests of an orchestrator that went away", len(orphans))
                await self._release(set(orphans))

    async def stop(self) -> None:
        self.model_thread.shutdown()

    async def _take_rows(self, request_id: str, round_number: int, rows_end: int) -> TargetRows | DraftedAhead | None:
        """The request's rows up to this round: those of rounds it was not asked to draft for (the orchestrator
        chose k = 0 then) come first. Waits until this round's rows reach position `rows_end` (they may come in
        several messages: prompt chunks, a replay, bounded chunks of many rows), or takes the drafts made ahead from
        them, checked under the same lock as the wait so that a batch drafting ahead cannot take the rows between the
        two. None for a request lost with the target's stream, at once or while waiting. Raises DraftRequestError
        when they do not join up, CallFailed when the round's rows do not arrive in time."""
        key = (request_id, round_number)

        def arrived() -> bool:
            if key in self._ahead or request_id in self._lost:
                return True
            entry = self._rows.get(key)
            return entry is not None and entry[0].start_position + len(entry[0].next_tokens) >= rows_end

        async with self._arrived:
            self._drop_stale_rows()
            self._asked.add(key)
            try:
                await asyncio.wait_for(self._arrived.wait_for(arrived), self.settings.rows_timeout_s)
            except TimeoutError:
                raise CallFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no hidden states from the target for request {request_id!r} round {round_number} "
                    f"within {self.settings.rows_timeout_s} s",
                ) from None
            finally:
                self._asked.discard(key)
            if request_id in self._lost:
                self._lost.discard(request_id)  # answered once as needing a replay; rows from 0 clear _dropped
                for stale in [k for k in self._rows if k[0] == request_id and k[1] <= round_number]:
                    del self._rows[stale]  # rows that arrived since the loss: of no use now
                return None
            made = self._ahead.pop(key, None)
            return made[0] if made is not None else self._pop_rows(request_id, round_number)

    def _pop_rows(self, request_id: str, round_number: int) -> TargetRows:
        """Takes the request's rows of this round, after those of earlier rounds it was not asked to draft for
        (the orchestrator chose k = 0 then); the caller holds the rows' lock."""
        return join_rounds([rows for rows, _ in pop_rounds(self._rows, request_id, round_number)])

    def _drop_stale_rows(self) -> None:
        oldest = time.monotonic() - self.settings.rows_ttl_s
        self._released = drop_stale(self._rows, self._ahead, self._released, oldest)

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await self.model_thread.run(function, *args)
