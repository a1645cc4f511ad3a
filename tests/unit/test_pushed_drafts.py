"""Drafts a replica pushes to the target (target_server/pushed.py and TargetService), on a real tiny target.

An item with `pushed_drafts` is verified with the drafts its request's replica pushed for the previous round, cut to
the item's limit; drafts that do not come in time, come malformed or come from a replica whose streams ended leave
the item verified without drafts and say why, and the request goes on. Pushes are kept only for running requests
whose rows go to the replica that pushed them, and a release drops them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from tandem.model_thread import ModelThread
from tandem.models.registry import load_target
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from target_server.main import target_info
from target_server.pushed import checked
from target_server.runner import TargetRunner
from target_server.service import Subscriber, TargetService
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target

CACHE = KVCacheSettings(num_blocks=64, block_size=4)
SESSION = "session"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


def new_service(target_dir: Path) -> TargetService:
    runner = TargetRunner(load_target(target_dir), CACHE, 256)
    service = TargetService(runner, target_info(runner, "float32"), ModelThread("target-test", 1), 30.0)
    service.subscribers["r0"] = Subscriber((1, 2, 3), tokens_only=False)
    return service


def opening(request_id: str = "a") -> target_pb2.StepRequest:
    """The request's whole prompt, its rows to replica r0, which drafts its next round ahead and pushes it."""
    item = target_pb2.StepItem(
        request_id=request_id, round=1, num_tokens=len(PROMPT), draft_replica="r0", draft_ahead=3, push_drafts=True
    )
    item.open.CopyFrom(target_pb2.OpenRequest(prompt=PROMPT))
    return target_pb2.StepRequest(items=[item])


def verification(
    pushed: int = 0, drafts: Sequence[int] = (), wait_s: float = 5.0, request_id: str = "a"
) -> target_pb2.StepRequest:
    item = target_pb2.StepItem(request_id=request_id, round=2, num_tokens=1, draft_tokens=drafts, pushed_drafts=pushed)
    return target_pb2.StepRequest(items=[item], pushed_wait_seconds=wait_s)


def push(service: TargetService, tokens: Sequence[int], parents: Sequence[int] = (), replica: str = "r0") -> None:
    drafts = target_pb2.PushedDrafts(request_id="a", round=1, draft_tokens=tokens, parents=parents)
    service.pushed.add(target_pb2.PushedBatch(replica_id=replica, drafts=[drafts], compute_seconds=0.002))


async def greedy_continuation(target_dir: Path, count: int) -> list[int]:
    """The target's own next tokens after the prompt's first new token (what a perfect draft would push)."""
    service = new_service(target_dir)
    first = await service._step(opening(), SESSION)
    tokens = list(first.results[0].new_tokens)
    item = target_pb2.StepItem(request_id="a", round=2, num_tokens=1, decode_steps=count)
    decoded = await service._step(target_pb2.StepRequest(items=[item]), SESSION)
    await service.stop()
    return tokens + list(decoded.results[0].new_tokens)


def test_pushed_drafts_are_verified_as_the_same_drafts_carried_by_the_item(target_dir: Path) -> None:
    async def scenario() -> None:
        continuation = await greedy_continuation(target_dir, 4)
        drafts = [*continuation[1:4], 3]  # three the target agrees with, then one it does not
        pushed_service, carried_service = new_service(target_dir), new_service(target_dir)
        for service in (pushed_service, carried_service):
            opened = await service._step(opening(), SESSION)
            assert list(opened.results[0].new_tokens) == continuation[:1]
        # The rows of the opening step ask the replica to push its drafts.
        batch = pushed_service.subscribers["r0"].queue.get_nowait()
        assert batch is not None
        (rows,) = batch.rows
        assert rows.push and rows.draft_ahead == 3
        push(pushed_service, drafts)
        pushed = await pushed_service._step(verification(pushed=3), SESSION)
        carried = await carried_service._step(verification(drafts=drafts[:3]), SESSION)
        (by_push,), (by_item,) = pushed.results, carried.results
        assert list(by_push.pushed_tokens) == drafts[:3] and not by_push.HasField("draft_error")
        assert (by_push.accepted, list(by_push.new_tokens)) == (by_item.accepted, list(by_item.new_tokens))
        assert by_push.accepted == 3 and by_push.draft_compute_seconds == pytest.approx(0.002)
        assert len(pushed_service.pushed) == 0  # used
        for service in (pushed_service, carried_service):
            await service.stop()

    asyncio.run(scenario())


def test_drafts_that_do_not_come_leave_the_item_verified_without_them(target_dir: Path) -> None:
    async def scenario() -> None:
        service = new_service(target_dir)
        await service._step(opening(), SESSION)
        response = await service._step(verification(pushed=3, wait_s=0.05), SESSION)
        (result,) = response.results
        assert not result.HasField("error") and len(result.new_tokens) == 1 and result.accepted == 0
        assert result.draft_error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "no drafts pushed for request 'a' round 1" in result.draft_error.message
        assert response.pushed_wait_seconds >= 0.05
        await service.stop()

    asyncio.run(scenario())


def test_drafts_of_a_replica_whose_streams_ended_are_not_waited_for(target_dir: Path) -> None:
    async def scenario() -> None:
        service = new_service(target_dir)
        await service._step(opening(), SESSION)
        del service.subscribers["r0"]
        service.pushed.replica_left()
        # A wait of an hour: the step comes back at once because the drafts can no longer come.
        response = await asyncio.wait_for(service._step(verification(pushed=3, wait_s=3600), SESSION), 60)
        (result,) = response.results
        assert len(result.new_tokens) == 1 and "streams have ended" in result.draft_error.message
        await service.stop()

    asyncio.run(scenario())


def test_malformed_pushes_are_refused_and_the_request_goes_on(target_dir: Path) -> None:
    async def scenario() -> None:
        service = new_service(target_dir)
        vocab_size = service.runner.model.config.vocab_size
        await service._step(opening(), SESSION)
        push(service, [1, vocab_size + 7])
        (result,) = (await service._step(verification(pushed=3), SESSION)).results
        assert not result.HasField("error") and len(result.new_tokens) == 1
        assert result.draft_error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"draft ids outside the vocabulary [0, {vocab_size})" in result.draft_error.message
        await service.stop()

    asyncio.run(scenario())


def test_pushes_are_kept_only_from_the_requests_replica_and_dropped_on_release(target_dir: Path) -> None:
    async def scenario() -> None:
        service = new_service(target_dir)
        service.subscribers["r1"] = Subscriber((1, 2, 3), tokens_only=False)
        await service._step(opening(), SESSION)
        push(service, [1, 2], replica="r1")  # another replica's: not this request's
        assert len(service.pushed) == 0 and service.pushed.dropped == 1
        push(service, [1, 2])
        assert len(service.pushed) == 1
        await service._release(["a"])
        assert len(service.pushed) == 0
        push(service, [1, 2])  # after the release: nobody will verify it
        assert len(service.pushed) == 0
        await service.stop()

    asyncio.run(scenario())


def test_an_item_may_not_carry_drafts_and_take_pushed_ones(target_dir: Path) -> None:
    async def scenario() -> None:
        service = new_service(target_dir)
        await service._step(opening(), SESSION)
        (result,) = (await service._step(verification(pushed=2, drafts=[1, 2]), SESSION)).results
        assert result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "an item with pushed_drafts carries none" in result.error.message
        await service.stop()

    asyncio.run(scenario())


def test_a_push_is_cut_to_the_items_limits() -> None:
    chain = target_pb2.PushedDrafts(request_id="a", round=1, draft_tokens=[4, 5, 6, 7])
    assert checked(chain, 2, 0, 100, 0.0).tokens == (4, 5)
    assert checked(chain, 4, 3, 100, 0.0).tokens == (4, 5, 6)
    # Two branches under the last committed token: 4 -> 6 -> 7 and 5 -> 8.
    tree = target_pb2.PushedDrafts(request_id="a", round=1, draft_tokens=[4, 5, 6, 7, 8], parents=[-1, -1, 0, 2, 1])
    by_count = checked(tree, 3, 0, 100, 0.0)
    assert (by_count.tokens, by_count.parents) == ((4, 5, 6), (-1, -1, 0))
    by_depth = checked(tree, 5, 2, 100, 0.0)  # 7 is three deep
    assert (by_depth.tokens, by_depth.parents) == ((4, 5, 6, 8), (-1, -1, 0, 1))
    bad_tree = target_pb2.PushedDrafts(request_id="a", round=1, draft_tokens=[4, 5], parents=[-1, 1])
    failure = checked(bad_tree, 3, 0, 100, 0.0).error
    assert failure is not None and failure.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "parents[1]: 1 must be -1" in str(failure)
