"""Faults injected into a running stack whose services run as separate processes, as in a cluster: a draft that
stops answering (SIGSTOP), a draft whose KV pool runs out, a target that hangs (SIGSTOP), a draft that proposes ids
outside the vocabulary, an orchestrator killed mid-request (SIGKILL), malformed and oversized messages. Each time
only the requests concerned fail, with the right code and message; greedy outputs stay those of the target alone;
every KV block comes back on target and draft; the stack serves on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fault_proxy import FaultProxy
from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import Completion, Service, draft_info, generate, service, tandem_command, target_info

BLOCK_SIZE = 8
ORPHAN_TIMEOUT = "1"
TARGET_TIMEOUT = "3"
DRAFT_TIMEOUT = "1"
CACHE = ("--block-size", str(BLOCK_SIZE), "--orphan-timeout", ORPHAN_TIMEOUT)  # target's and replicas' alike
# A demoted replica is probed again every 0.5 s (1 s doubling to 30 s by default): once it answers, it drafts soon.
REPROBE = ("--reprobe-max-interval", "0.5")


def orchestrator_command(target: Service, drafts: list[str], tokenizer: Path, *flags: str) -> list[str]:
    arguments = ["orchestrator", "--target-address", target.address, "--tokenizer", str(tokenizer), *flags]
    arguments += ["--speculative-num-steps", "3", "--no-adaptive-k", "--port", "0", "--admin-port", "0"]
    arguments += ["--target-timeout", TARGET_TIMEOUT, "--draft-timeout", DRAFT_TIMEOUT, *REPROBE]
    for address in drafts:
        arguments += ["--draft-address", address]
    return tandem_command(*arguments)


def draft_command(model: Path, target_address: str, replica_id: str, kv_blocks: int) -> list[str]:
    """`tandem draft` with this module's CACHE settings and 3 steps."""
    return tandem_command(
        "draft", "--model", str(model), "--target-address", target_address, "--port", "0",
        "--replica-id", replica_id, "--speculative-num-steps", "3", "--kv-blocks", str(kv_blocks), *CACHE,
    )  # fmt: skip


def replica_idle(address: str) -> bool:
    """Whether the replica holds no request and its pool is whole."""
    info = draft_info(address)
    return (info.running_requests, info.kv_blocks_free) == (0, info.kv_blocks_total)


@dataclass
class Stack:
    target: Service
    draft: Service
    workdir: Path
    tokenizer: Path
    draft_model: Path


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("faults")
    config = json.loads((llama_target / "config.json").read_text())
    # A pool sized by memory: 24 blocks of the target's float32 KV.
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block_bytes = config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"] * 2 * head_dim * 4
    target_command = tandem_command(
        "target", "--model", str(llama_target), "--port", "0", "--kv-cache-memory", str(24 * block_bytes), *CACHE
    )
    with (
        service("target", target_command, workdir) as target,
        service("draft", draft_command(random_draft, target.address, "draft-0", 64), workdir) as draft,
    ):
        yield Stack(target, draft, workdir, llama_target, random_draft)


@contextmanager
def orchestrator(stack: Stack, drafts: list[str] | None = None, *flags: str) -> Iterator[Service]:
    addresses = [stack.draft.address] if drafts is None else drafts
    command = orchestrator_command(stack.target, addresses, stack.tokenizer, *flags)
    with service("orchestrator", command, stack.workdir) as run:
        yield run


def held(stack: Stack) -> tuple[int, int, int, int]:
    """(target requests, target blocks in use, draft requests, draft blocks in use)."""
    target, draft = target_info(stack.target.address), draft_info(stack.draft.address)
    return (
        target.running_requests,
        target.kv_blocks_total - target.kv_blocks_free,
        draft.running_requests,
        draft.kv_blocks_total - draft.kv_blocks_free,
    )


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def assert_nothing_held(stack: Stack) -> None:
    try:
        wait_for(lambda: held(stack) == (0, 0, 0, 0), "every request and KV block back")
    except AssertionError as failure:
        logs = "".join(f"--- {s.name}, last lines:\n{''.join(s.log[-40:])}" for s in (stack.target, stack.draft))
        raise AssertionError(f"{failure} (held: {held(stack)})\n{logs}") from None


def health(address: str) -> int:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(answer.status)


PROMPT = [1, 17, 42, 99, 5, 23]


def reference(address: str, new_tokens: int) -> list[int]:
    return generate(
        address, input_ids=PROMPT, max_new_tokens=new_tokens, ignore_eos=True, disable_speculation=True
    ).token_ids


def speculative(address: str, new_tokens: int) -> Completion:
    return generate(address, input_ids=PROMPT, max_new_tokens=new_tokens, ignore_eos=True)


def test_the_pool_is_sized_by_memory(stack: Stack) -> None:
    info = target_info(stack.target.address)
    assert (info.kv_blocks_total, info.kv_block_size) == (24, BLOCK_SIZE)


def test_a_stopped_draft_costs_rounds_without_drafts_then_rejoins(stack: Stack) -> None:
    with orchestrator(stack) as run:
        expected = reference(run.address, 40)
        assert speculative(run.address, 40).stats.draft_tokens > 0
        os.kill(stack.draft.process.pid, signal.SIGSTOP)
        try:
            slow = speculative(run.address, 40)
        finally:
            os.kill(stack.draft.process.pid, signal.SIGCONT)
        assert slow.token_ids == expected
        assert any("draft replica draft-0 demoted" in line for line in run.log)
        # Probed again with backoff, the replica serves new requests once it answers.
        wait_for(lambda: speculative(run.address, 8).stats.draft_tokens > 0, "the replica drafts again")
        assert speculative(run.address, 40).token_ids == expected
        assert_nothing_held(stack)


def test_a_hung_target_fails_its_requests_loudly_and_health_says_so(stack: Stack) -> None:
    # Hung past --target-timeout, then past --target-wait (tests/integration/test_target_faults.py: a target that
    # answers within the wait costs time only).
    with orchestrator(stack, None, "--target-wait", "2") as run:
        expected = reference(run.address, 24)
        assert health(run.address) == health_pb2.HealthCheckResponse.SERVING
        os.kill(stack.target.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as caught:
                speculative(run.address, 24)
            wait_for(
                lambda: health(run.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                "the orchestrator reports NOT_SERVING",
            )
        finally:
            os.kill(stack.target.process.pid, signal.SIGCONT)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        details = caught.value.details()  # type: ignore[attr-defined]
        assert "no target answered within 2 s (--target-wait)" in details, details
        assert f"after target step: DEADLINE_EXCEEDED: no answer within {float(TARGET_TIMEOUT)} s" in details, details
        wait_for(lambda: health(run.address) == health_pb2.HealthCheckResponse.SERVING, "SERVING again")
        assert speculative(run.address, 24).token_ids == expected
        assert_nothing_held(stack)


def test_a_draft_out_of_kv_costs_rounds_without_drafts_not_the_replica(stack: Stack) -> None:
    # A second replica whose pool holds 5 blocks (40 positions): one request of 6 + 30 tokens plus its 3 drafts
    # fits, three at once do not. Those that do not fit go without drafts for the round (RESOURCE_EXHAUSTED from the
    # replica, per request), are replayed later; the replica stays in service and every output stays the target's.
    small_command = draft_command(stack.draft_model, stack.target.address, "draft-small", 5)
    with service("small-draft", small_command, stack.workdir) as small, orchestrator(stack, [small.address]) as run:
        expected = reference(run.address, 30)
        with ThreadPoolExecutor(3) as pool:
            completions = list(pool.map(lambda _: speculative(run.address, 30), range(3)))
        assert [c.token_ids for c in completions] == [expected] * 3
        log = "".join(run.log)
        assert "goes without drafts this round" in log and "KV" in log, log[-2000:]
        assert "demoted" not in log, log[-2000:]
        assert sum(c.stats.draft_tokens for c in completions) > 0
        assert speculative(run.address, 16).stats.draft_tokens > 0  # the replica still drafts
        wait_for(lambda: replica_idle(small.address), "the small replica holds no request and its pool is whole again")
    assert_nothing_held(stack)


def test_a_draft_proposing_ids_outside_the_vocabulary_is_demoted_and_outputs_stay_right(stack: Stack) -> None:
    vocab_size = target_info(stack.target.address).vocab_size
    corrupting = [
        sys.executable, "-m", "tests.helpers.corrupting_draft",
        "--upstream", stack.draft.address, "--vocab-size", str(vocab_size),
    ]  # fmt: skip
    with service("corrupting-draft", corrupting, stack.workdir) as liar, orchestrator(stack, [liar.address]) as run:
        expected = reference(run.address, 32)
        completion = speculative(run.address, 32)
        assert completion.token_ids == expected
        assert completion.stats.accepted_tokens == 0
        assert any("demoted" in line and "outside" in line for line in run.log), "".join(run.log[-20:])
    assert_nothing_held(stack)


def test_a_killed_orchestrator_leaves_nothing_behind(stack: Stack) -> None:
    with orchestrator(stack) as run, grpc.insecure_channel(run.address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = orchestrator_pb2.GenerateRequest(input_ids=PROMPT, max_new_tokens=150, ignore_eos=True)
        call = stub.Generate(request)
        next(iter(call))
        in_use = held(stack)
        assert in_use[0] == 1 and in_use[1] > 0, in_use
        run.process.kill()
        with pytest.raises(grpc.RpcError):
            for _ in call:
                pass
    # The target and the draft notice that the orchestrator's session is gone and free what it held.
    assert_nothing_held(stack)
    with orchestrator(stack) as again:
        assert speculative(again.address, 16).stats.draft_tokens > 0
    assert_nothing_held(stack)


def test_malformed_and_oversized_messages_are_refused_and_the_stack_serves_on(stack: Stack) -> None:
    with orchestrator(stack) as run, grpc.insecure_channel(run.address, options=channel_options()) as channel:
        raw = channel.unary_stream(
            "/tandem.v1.Orchestrator/Generate", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(raw(b"\x0a\xff\xff\xff\xff\x0f"))  # field 1 (prompt) claims more bytes than follow
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "/tandem.v1.Orchestrator/Generate: the request message does not parse" in (
            caught.value.details()  # type: ignore[attr-defined]
        )
        with pytest.raises(grpc.RpcError) as caught:
            generate(run.address, prompt="x" * (5 * 1024 * 1024))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "larger than max" in caught.value.details()  # type: ignore[attr-defined]
        assert speculative(run.address, 8).finish_reason == "length"
    assert_nothing_held(stack)


def test_a_replica_whose_target_stream_resets_subscribes_again_and_outputs_stay_right(stack: Stack) -> None:
    # A second replica reaches the target through a fault proxy; resetting every connection through it breaks its
    # hidden-state stream (and its channel) mid-request. It drops what it held, subscribes again, and its requests
    # are replayed to it: outputs stay the target's, the replica never exits, and it drafts again afterwards.
    proxy = FaultProxy(stack.target.address)
    proxied_command = draft_command(stack.draft_model, proxy.address, "draft-proxied", 64)
    try:
        with (
            service("proxied-draft", proxied_command, stack.workdir) as proxied,
            orchestrator(stack, [proxied.address]) as run,
        ):
            expected = reference(run.address, 60)
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(speculative, run.address, 60) for _ in range(4)]
                wait_for(lambda: draft_info(proxied.address).running_requests > 0, "the streams reach the replica")
                assert proxy.reset() > 0
                completions = [future.result(timeout=120) for future in futures]
            assert [c.token_ids for c in completions] == [expected] * 4
            assert proxied.process.poll() is None, "".join(proxied.log[-20:])
            wait_for(
                lambda: any("hidden-state stream from the target broke" in line for line in proxied.log),
                "the replica notices that its stream broke",
            )
            wait_for(lambda: speculative(run.address, 16).stats.draft_tokens > 0, "the replica drafts again")
            wait_for(lambda: replica_idle(proxied.address), "the proxied replica holds nothing and its pool is whole")
    finally:
        proxy.close()
    assert_nothing_held(stack)
