"""Drafting ahead in the draft service (draft_server/service.py), on a real tiny EAGLE3 head and its runner.

Rows that carry `draft_ahead` are drafted as one batch when the step's last message (`step_end`) arrives; a Propose
for the same round takes those drafts (the first ones of a longer chain), drafts again from the same rows when it
asks for more, and never races a Propose that was already waiting for the rows. Released requests keep no KV.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import pytest

from draft_server.formats import prepare_draft
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from draft_server.service import DraftService
from draft_server.settings import DraftSettings
from tandem.model_thread import ModelThread
from tandem.models.registry import load_target
from tandem.settings import KVCacheSettings
from tandem.wire import draft_pb2, target_pb2
from tandem.wire.codec import tensor_to_proto
from target_server.items import RowStream
from target_server.main import target_info
from target_server.runner import TargetRunner
from target_server.service import Subscriber, TargetService
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.target_rows import random_rows

CACHE = KVCacheSettings(num_blocks=64, block_size=4)
SESSION = "session"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture(scope="module")
def draft_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    return write_tiny_eagle3(tmp_path_factory.mktemp("draft"), target_dir, spec)


def message(
    request_id: str, round_number: int, rows: TargetRows, ahead: int, step_end: bool
) -> target_pb2.HiddenStates:
    return target_pb2.HiddenStates(
        request_id=request_id,
        round=round_number,
        start_position=rows.start_position,
        next_tokens=list(rows.next_tokens),
        features=tensor_to_proto(rows.features),
        draft_ahead=ahead,
        step_end=step_end,
    )


def propose_request(request_id: str, round_number: int, num_steps: int, rows_end: int) -> draft_pb2.ProposeRequest:
    item = draft_pb2.ProposeItem(request_id=request_id, round=round_number, num_steps=num_steps, rows_end=rows_end)
    return draft_pb2.ProposeRequest(items=[item])


class Stream:
    """The target's hidden-state stream, fed by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[target_pb2.HiddenBatch] = asyncio.Queue()

    async def messages(self) -> AsyncIterator[target_pb2.HiddenBatch]:
        while True:
            yield await self.queue.get()


class Replica:
    """A DraftService as `tandem draft` builds it, with its consumer running on a test-fed stream."""

    def __init__(self, target_dir: Path, draft_dir: Path, cache: KVCacheSettings = CACHE) -> None:
        settings = DraftSettings(model_dir=draft_dir, target_address="", replica_id="r0", cache=cache, threads=1)
        runner = TargetRunner(load_target(target_dir), CACHE, 256)
        prepared = prepare_draft(settings, target_info(runner, "float32"))
        self.service = DraftService(prepared.build_runner(cache), settings, prepared, ModelThread("draft-test", 1))
        self.stream = Stream()
        self.consumer = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        async for batch in self.stream.messages():
            await self.service.store(batch)

    async def send(self, *messages: target_pb2.HiddenStates) -> None:
        """Writes the messages as the target writes a step's rows: in one batch."""
        await self.forward(target_pb2.HiddenBatch(rows=messages))

    async def forward(self, *batches: target_pb2.HiddenBatch | None) -> None:
        """Writes batches a target service queued for its replica's stream."""
        for batch in batches:
            assert batch is not None
            self.stream.queue.put_nowait(batch)
        while not self.stream.queue.empty():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.001)  # the consumer handles it

    async def drafted_ahead(self) -> None:
        """Waits until every batch drafted ahead so far has finished."""
        for made, _ in list(self.service._ahead.values()):
            await made.done

    async def __aenter__(self) -> Replica:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.consumer.cancel()
        await self.service.stop()


def plain_proposals(draft_dir: Path, target_dir: Path, inputs: Sequence[ProposeInput]) -> list[list[int]]:
    """What a fresh runner of the same head drafts for the same rows, asked directly."""
    settings = DraftSettings(model_dir=draft_dir, target_address="", replica_id="plain", cache=CACHE)
    prepared = prepare_draft(settings, target_info(TargetRunner(load_target(target_dir), CACHE, 256), "float32"))
    runner = prepared.build_runner(CACHE)
    assert isinstance(runner, DraftRunner)
    return [runner.propose([item])[0] for item in inputs]


def test_drafts_made_ahead_answer_the_propose_of_their_round(draft_dir: Path, target_dir: Path) -> None:
    rows = random_rows(0, 6, seed=1)
    (expected_four,) = plain_proposals(draft_dir, target_dir, [ProposeInput("a", rows, 4)])
    (expected_five,) = plain_proposals(draft_dir, target_dir, [ProposeInput("b", rows, 5)])

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            # Rows that ask for it are not drafted before the step's last message...
            await replica.send(message("a", 1, rows, ahead=4, step_end=False))
            assert not replica.service._ahead
            await replica.send(message("b", 1, rows, ahead=4, step_end=False))
            await replica.send(message("c", 1, rows, ahead=4, step_end=True))
            # ...then all of them, in one batch.
            assert set(replica.service._ahead) == {("a", 1), ("b", 1), ("c", 1)}
            await replica.drafted_ahead()
            answer = await replica.service._propose(propose_request("a", 1, 4, 6), SESSION)
            assert list(answer.results[0].drafts.tokens) == expected_four
            assert answer.ahead_seconds > 0 and answer.compute_seconds == 0
            # A shorter chain is the start of the one drafted; a longer one is drafted again from the same rows.
            shorter = await replica.service._propose(propose_request("b", 1, 2, 6), SESSION)
            assert list(shorter.results[0].drafts.tokens) == expected_four[:2]
            longer = await replica.service._propose(propose_request("c", 1, 5, 6), SESSION)
            assert list(longer.results[0].drafts.tokens) == expected_five
            assert longer.compute_seconds > 0
            assert not replica.service._ahead

    asyncio.run(scenario())


def test_a_propose_waiting_for_the_rows_is_not_raced_by_drafting_ahead(draft_dir: Path, target_dir: Path) -> None:
    rows = random_rows(0, 5, seed=2)
    (expected,) = plain_proposals(draft_dir, target_dir, [ProposeInput("a", rows, 3)])

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            asked = asyncio.create_task(replica.service._propose(propose_request("a", 1, 3, 5), SESSION))
            await asyncio.sleep(0.01)  # the call waits for the rows
            await replica.send(message("a", 1, rows, ahead=3, step_end=True))
            answer = await asked
            assert list(answer.results[0].drafts.tokens) == expected
            assert answer.ahead_seconds == 0 and not replica.service._ahead

    asyncio.run(scenario())


def test_a_request_released_while_drafted_ahead_keeps_no_kv(draft_dir: Path, target_dir: Path) -> None:
    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            runner = replica.service.runner
            await replica.send(
                message("a", 1, random_rows(0, 9, seed=3), ahead=5, step_end=False),
                message("b", 1, random_rows(0, 7, seed=4), ahead=5, step_end=True),
            )
            batch = [made for made, _ in replica.service._ahead.values()]
            assert len(batch) == 2
            # Released right after the batch was queued: the release runs after it on the model thread and frees it.
            await replica.service._release({"a", "b"})
            assert all(made.done.done() for made in batch)
            assert not replica.service._ahead and not runner.requests
            assert runner.cache.num_free_blocks == runner.cache.num_blocks

    asyncio.run(scenario())


def test_the_target_marks_the_step_end_and_the_rounds_that_may_be_drafted_ahead(target_dir: Path) -> None:
    runner = TargetRunner(load_target(target_dir), CACHE, 256)
    service = TargetService(runner, target_info(runner, "float32"), ModelThread("target-test", 1), 30.0)
    service.subscribers["r0"] = Subscriber(RowStream((1, 2, 3)))

    def item(request_id: str, num_tokens: int, prompt: Sequence[int] = (), ahead: int = 3) -> target_pb2.StepItem:
        message = target_pb2.StepItem(
            request_id=request_id, round=1, num_tokens=num_tokens, draft_replica="r0", draft_ahead=ahead
        )
        if prompt:
            message.open.CopyFrom(target_pb2.OpenRequest(prompt=prompt))
        return message

    async def scenario() -> list[list[target_pb2.HiddenStates]]:
        sent = []
        # "a" computes its whole prompt and commits its first token; "b" only the first chunk of its prompt.
        for request in (
            target_pb2.StepRequest(items=[item("a", 4, [5, 6, 7, 8]), item("b", 2, [9, 10, 11])]),
            target_pb2.StepRequest(items=[item("a", 1, ahead=0), item("b", 1)]),
        ):
            response = await service._step(request, SESSION)
            assert not any(result.HasField("error") for result in response.results)
            queue = service.subscribers["r0"].queue
            batches = [queue.get_nowait() for _ in range(queue.qsize())]
            assert len(batches) == 1  # a step's rows for a replica go in one write
            sent.append([message for batch in batches if batch is not None for message in batch.rows])
        await service.stop()
        return sent

    first, second = asyncio.run(scenario())
    assert [(m.request_id, m.draft_ahead, m.step_end) for m in first] == [("a", 3, False), ("b", 0, True)]
    # In the second step "a" decodes without being asked to draft ahead and "b" finishes its prompt.
    assert [(m.request_id, m.draft_ahead, m.step_end) for m in second] == [("a", 0, False), ("b", 3, True)]


def test_one_propose_takes_some_requests_drafted_ahead_and_drafts_the_others(draft_dir: Path, target_dir: Path) -> None:
    first, second = random_rows(0, 5, seed=5), random_rows(0, 8, seed=6)
    expected = plain_proposals(draft_dir, target_dir, [ProposeInput("a", first, 3), ProposeInput("b", second, 3)])

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            # "a" was not asked to draft ahead; "b" was, and its step ended: b is drafted ahead, a waits to be asked.
            await replica.send(message("a", 1, first, ahead=0, step_end=False))
            await replica.send(message("b", 1, second, ahead=3, step_end=True))
            request = draft_pb2.ProposeRequest(
                items=[
                    draft_pb2.ProposeItem(request_id="a", round=1, num_steps=3, rows_end=5),
                    draft_pb2.ProposeItem(request_id="b", round=1, num_steps=3, rows_end=8),
                ]
            )
            answer = await asyncio.wait_for(replica.service._propose(request, SESSION), 30)
            assert [list(result.drafts.tokens) for result in answer.results] == expected
            assert replica.service.drafted_ahead == 1

    asyncio.run(scenario())


def test_rows_of_a_released_request_are_not_drafted_ahead(draft_dir: Path, target_dir: Path) -> None:
    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            await replica.service._release({"gone"})
            # Its last rows overtaken by the release: drafting them would hold KV for a request nobody asks about.
            await replica.send(message("gone", 4, random_rows(0, 6, seed=7), ahead=3, step_end=True))
            assert not replica.service._ahead and not replica.service.runner.requests

    asyncio.run(scenario())


def test_a_request_dropped_for_kv_room_is_answered_as_needing_a_replay(draft_dir: Path, target_dir: Path) -> None:
    # 10 blocks of 4 positions: one request of 24 rows and its drafts fits, two do not.
    small = KVCacheSettings(num_blocks=10, block_size=4)

    def ask(request_ids: Sequence[str], round_number: int, rows_end: int) -> draft_pb2.ProposeRequest:
        items = [
            draft_pb2.ProposeItem(request_id=i, round=round_number, num_steps=3, rows_end=rows_end) for i in request_ids
        ]
        return draft_pb2.ProposeRequest(items=items)

    async def scenario() -> list[draft_pb2.ProposeResponse]:
        async with Replica(target_dir, draft_dir, small) as replica:
            await replica.send(
                message("a", 1, random_rows(0, 24, seed=11), ahead=3, step_end=False),
                message("b", 1, random_rows(0, 24, seed=12), ahead=3, step_end=True),
            )
            first = await replica.service._propose(ask(["a", "b"], 1, 24), SESSION)
            # The next round's rows continue both; "b" holds nothing here any more, so it is not drafted ahead (which
            # would fail the whole batch) but answered as needing a replay, and "a" is drafted as usual.
            await replica.send(
                message("a", 2, random_rows(24, 1, seed=13), ahead=3, step_end=False),
                message("b", 2, random_rows(24, 1, seed=14), ahead=3, step_end=True),
            )
            await replica.drafted_ahead()  # else, under load, the call can arrive before the batch starts
            second = await replica.service._propose(ask(["a", "b"], 2, 25), SESSION)
            # Once there is room, rows that start over (a replay) are drafted again.
            await replica.service._release({"a"})
            await replica.send(message("b", 3, random_rows(0, 25, seed=15), ahead=3, step_end=True))
            third = await replica.service._propose(ask(["b"], 3, 25), SESSION)
            return [first, second, third]

    first, second, third = asyncio.run(scenario())
    outcome = [[(r.request_id, r.HasField("error"), len(r.drafts.tokens)) for r in b.results] for b in (first, second)]
    assert outcome == [[("a", False, 3), ("b", True, 0)], [("a", False, 3), ("b", True, 0)]]
    assert "needs a replay" in second.results[1].error.message
    assert second.ahead_seconds > 0  # the batch's, not the undrafted request's nothing
    assert [(r.request_id, r.HasField("error")) for r in third.results] == [("b", False)]


def test_requests_lost_with_the_targets_stream_answer_at_once_as_needing_a_replay(
    draft_dir: Path, target_dir: Path
) -> None:
    async def scenario() -> tuple[draft_pb2.ProposeResponse, draft_pb2.ProposeResponse, int, draft_pb2.ProposeResponse]:
        async with Replica(target_dir, draft_dir) as replica:
            await replica.send(message("a", 1, random_rows(0, 6, seed=21), ahead=0, step_end=True))
            first = await replica.service._propose(propose_request("a", 1, 3, 6), SESSION)
            # A Propose waits for the next round's rows; the stream breaks and they are lost with it...
            waiting = asyncio.create_task(replica.service._propose(propose_request("a", 2, 3, 7), SESSION))
            await asyncio.sleep(0.01)
            assert await replica.service.lose_all() == 1
            second = await asyncio.wait_for(waiting, 5)  # ...so it answers at once, not after rows_timeout_s
            held = len(replica.service.runner.requests)
            # The replay its orchestrator sends (rows from position 0) is drafted as usual.
            await replica.send(message("a", 3, random_rows(0, 7, seed=22), ahead=0, step_end=True))
            third = await replica.service._propose(propose_request("a", 3, 3, 7), SESSION)
            return first, second, held, third

    first, second, held, third = asyncio.run(scenario())
    assert not first.results[0].HasField("error")
    assert second.results[0].HasField("error") and "stream broke" in second.results[0].error.message
    assert second.results[0].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert held == 0
    assert not third.results[0].HasField("error") and len(third.results[0].drafts.tokens) == 3


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.005)


def open_item(request_id: str, prompt: Sequence[int], ahead: int = 0) -> target_pb2.StepItem:
    return target_pb2.StepItem(
        request_id=request_id,
        round=1,
        num_tokens=len(prompt),
        draft_replica="r0",
        draft_ahead=ahead,
        open=target_pb2.OpenRequest(prompt=prompt),
    )


def test_a_request_the_target_frees_as_an_orphan_is_freed_on_its_replica_too(draft_dir: Path, target_dir: Path) -> None:
    runner = TargetRunner(load_target(target_dir), CACHE, 256)
    target = TargetService(runner, target_info(runner, "float32"), ModelThread("target-test", 1), 0.05)
    subscriber = target.subscribers["r0"] = Subscriber(RowStream((1, 2, 3)))

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            # The prompt's step asks the replica to draft ahead: it makes the request's state with no Propose, so no
            # orchestrator session owns the request on the replica.
            await target._step(target_pb2.StepRequest(items=[open_item("a", [5, 6, 7, 8], ahead=3)]), SESSION)
            await replica.forward(*[subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())])
            await replica.drafted_ahead()
            draft = replica.service.runner
            assert "a" in draft.requests and replica.service.leases.owned() == 0
            # The session holds no stream and made no call for the orphan timeout: the target frees the request and
            # tells the replica, which frees its state too.
            sweep = asyncio.create_task(target.sweep_orphans(0.01))
            await until(lambda: not runner.requests, "the target freed the orphan")
            sweep.cancel()
            (batch,) = [subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())]
            assert batch is not None
            assert [(message.request_id, message.released) for message in batch.rows] == [("a", True)]
            await replica.forward(batch)
            await until(lambda: not draft.requests, "the replica freed it")
            assert draft.cache.num_free_blocks == draft.cache.num_blocks
            assert runner.cache.num_free_blocks == runner.cache.num_blocks
        await target.stop()

    asyncio.run(scenario())


class Gate:
    """Wraps a runner's method: a call starts, then waits until `opened` is set (the call runs on the model thread;
    the test cancels its caller meanwhile, as gRPC does when the caller dies)."""

    def __init__(self, owner: object, name: str) -> None:
        self.started, self.opened = threading.Event(), threading.Event()
        method = getattr(owner, name)

        def gated(*args: object) -> object:
            self.started.set()
            self.opened.wait(30)
            return method(*args)

        setattr(owner, name, gated)


def test_a_propose_cut_off_by_its_callers_death_leaves_what_it_made_to_the_callers_session(
    draft_dir: Path, target_dir: Path
) -> None:
    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            service = replica.service
            await replica.send(message("a", 1, random_rows(0, 6, seed=16), ahead=0, step_end=True))
            gate = Gate(service.runner, "propose")
            call = asyncio.create_task(service._propose(propose_request("a", 1, 3, 6), SESSION))
            await until(gate.started.is_set, "the drafting started")
            call.cancel()  # the orchestrator died: gRPC cancels the handler while the model thread drafts on
            gate.opened.set()
            await until(lambda: service.model_thread.pending == 0, "the drafting done")
            assert "a" in service.runner.requests and service.leases.owner("a") == SESSION
            assert service.leases.expired(time.monotonic() + 3600) == ["a"]  # what the sweep frees

    asyncio.run(scenario())


def test_a_step_cut_off_by_its_callers_death_leaves_the_request_it_opened_to_the_callers_session(
    target_dir: Path,
) -> None:
    runner = TargetRunner(load_target(target_dir), CACHE, 256)
    target = TargetService(runner, target_info(runner, "float32"), ModelThread("target-test", 1), 30.0)

    async def scenario() -> None:
        gate = Gate(runner, "step")
        call = asyncio.create_task(target._step(target_pb2.StepRequest(items=[open_item("a", [5, 6, 7])]), SESSION))
        await until(gate.started.is_set, "the step started")
        call.cancel()
        gate.opened.set()
        await until(lambda: target.model_thread.pending == 0, "the step done")
        assert "a" in runner.requests and target.leases.owner("a") == SESSION
        # An open that fails (the request is running already) leaves no claim: "a" stays its first session's.
        answer = await target._step(target_pb2.StepRequest(items=[open_item("a", [5, 6, 7])]), "another")
        assert "already running" in answer.results[0].error.message
        assert target.leases.owner("a") == SESSION and target.leases.owned() == 1
        await target.stop()

    asyncio.run(scenario())


def test_rows_from_the_target_keep_the_session_of_their_request_alive_on_the_replica(
    draft_dir: Path, target_dir: Path
) -> None:
    timeout_s = 0.5
    cache = KVCacheSettings(num_blocks=64, block_size=4, orphan_timeout_s=timeout_s)

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir, cache) as replica:
            leases = replica.service.leases
            await replica.send(message("a", 1, random_rows(0, 6, seed=17), ahead=0, step_end=True))
            await replica.service._propose(propose_request("a", 1, 3, 6), SESSION)  # owned; no stream is open
            # Longer than the timeout without a call: the orchestrator's drafts go to the target, which still runs
            # the request and streams its rows here.
            await asyncio.sleep(timeout_s + 0.1)
            await replica.send(message("a", 2, random_rows(6, 2, seed=18), ahead=0, step_end=True))
            assert leases.expired(time.monotonic()) == []
            # Rows stop coming (the target freed the request, its orchestrator gone): the session expires.
            assert leases.expired(time.monotonic() + timeout_s + 0.1) == ["a"]

    asyncio.run(scenario())
