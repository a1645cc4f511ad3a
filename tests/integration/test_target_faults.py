"""A target that goes away under 8 greedy and 2 seeded sampled streams: killed and restarted at its address (by hand,
or by `tandem serve`), paused, or its link to the orchestrator reset. Every stream goes on where it was and ends with
the tokens of a run without the fault and without speculation (none repeated or missing); nothing stays held on the
target or the replica. A target that does not come back within --target-wait fails each request naming why, and the
next request after it returns is served.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.fault_proxy import FaultProxy
from bench.fault_stack import free_port
from launch.processes import ServeProcess
from tandem.grpc_util import LIVENESS
from tests.integration.fault_streams import (
    NEW_TOKENS,
    PROMPTS,
    assert_nothing_held,
    assert_streams_whole,
    streams_through,
    target_only,
    wait_for,
)
from tests.integration.stack import Service, generate, serve, service, tandem_command, target_info

CACHE = ("--block-size", "8", "--orphan-timeout", "1")
# A demoted replica is probed again every 0.5 s (1 s doubling to 30 s by default): once it answers, it drafts soon.
REPROBE = ("--reprobe-max-interval", "0.5")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Stack:
    workdir: Path
    model: Path
    port: int
    services: ExitStack
    target: Service
    draft: Service
    proxy: FaultProxy  # the orchestrator's link to the target
    orchestrator: Service
    expected: list[list[int]]  # each prompt's tokens from the target alone

    @property
    def target_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def restart_target(self, name: str) -> None:
        """Kills the target (SIGKILL) and starts a new one at its address."""
        self.target.process.kill()
        self.target.process.wait()
        self.target = start_target(self, name)


def orchestrator_command(model: Path, draft: Service, target_address: str, *flags: str) -> list[str]:
    return tandem_command(
        "orchestrator", "--target-address", target_address, "--tokenizer", str(model),
        "--draft-address", draft.address, "--speculative-num-steps", "3", "--no-adaptive-k",
        "--port", "0", "--admin-port", "0", "--target-timeout", "5", "--draft-timeout", "2", *REPROBE, *flags,
    )  # fmt: skip


def start_target(stack: Stack, name: str) -> Service:
    command = tandem_command("target", "--model", str(stack.model), "--port", str(stack.port), *CACHE)
    return stack.services.enter_context(service(name, command, stack.workdir))


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Target, one draft replica on the target's own address, and an orchestrator that reaches the target through a
    fault proxy."""
    workdir = tmp_path_factory.mktemp("target-faults")
    port = free_port()
    with ExitStack() as services:
        command = tandem_command("target", "--model", str(llama_target), "--port", str(port), *CACHE)
        target = services.enter_context(service("target", command, workdir))
        draft_command = tandem_command(
            "draft", "--model", str(random_draft), "--target-address", target.address, "--port", "0",
            "--replica-id", "draft-0", "--speculative-num-steps", "3", *CACHE,
        )  # fmt: skip
        draft = services.enter_context(service("draft", draft_command, workdir))
        proxy = FaultProxy(target.address)
        services.callback(proxy.close)
        command = orchestrator_command(llama_target, draft, proxy.address)
        orchestrator = services.enter_context(service("orchestrator", command, workdir))
        expected = target_only(orchestrator.address)
        yield Stack(workdir, llama_target, port, services, target, draft, proxy, orchestrator, expected)


def test_a_reset_link_to_the_target_costs_time_only(stack: Stack) -> None:
    def reset() -> None:
        assert stack.proxy.reset() > 0

    streams = streams_through(stack.orchestrator.address, reset)
    assert_streams_whole(streams, stack.expected)
    # A reset between steps costs a new stream; one during a step, a start over on the same target (told to free
    # the requests first), never a new instance.
    assert not any("a new target instance answers" in line for line in stack.orchestrator.log)
    assert_nothing_held(stack.target_address, [stack.draft.address])


def test_a_target_paused_past_its_timeout_costs_time_only(stack: Stack) -> None:
    # Stopped (SIGSTOP) past --target-timeout (5 s): the step in flight times out, and once the target answers again
    # it is the same instance, told to free the requests before they start over on it.
    def pause() -> None:
        os.kill(stack.target.process.pid, signal.SIGSTOP)
        time.sleep(7)
        os.kill(stack.target.process.pid, signal.SIGCONT)

    streams = streams_through(stack.orchestrator.address, pause)
    assert_streams_whole(streams, stack.expected)
    log = "".join(stack.orchestrator.log)
    lines = [line for line in stack.orchestrator.log if "target" in line]
    assert "requests wait for a target to start over on" in log, lines[-5:]
    assert "a new target instance answers" not in log
    assert_nothing_held(stack.target_address, [stack.draft.address])


def test_a_target_killed_and_restarted_at_its_address_resumes_every_stream(stack: Stack) -> None:
    instance = target_info(stack.target_address).instance
    streams = streams_through(stack.orchestrator.address, lambda: stack.restart_target("target-restarted"))
    assert target_info(stack.target_address).instance != instance
    assert_streams_whole(streams, stack.expected)
    assert any("a new target instance answers" in line for line in stack.orchestrator.log)
    assert stack.draft.process.poll() is None  # the replica followed the target; it did not exit
    wait_for(lambda: generate_drafts(stack.orchestrator.address) > 0, "the replica drafts again")
    assert_nothing_held(stack.target_address, [stack.draft.address])


def test_a_target_gone_past_the_wait_fails_each_request_naming_it_then_serves_again(stack: Stack) -> None:
    command = orchestrator_command(stack.model, stack.draft, stack.target_address, "--target-wait", "2")
    with service("orchestrator-waiting-2s", command, stack.workdir) as orchestrator:
        stack.target.process.kill()
        stack.target.process.wait()
        with pytest.raises(grpc.RpcError) as caught:
            generate(orchestrator.address, input_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        details = caught.value.details()  # type: ignore[attr-defined]
        assert "no target answered within 2 s (--target-wait) after target step: UNAVAILABLE" in details, details
        # Out of rotation while no target answers, not dead: a liveness probe leaves it running.
        wait_for(lambda: health(orchestrator.address, "") == NOT_SERVING, "NOT_SERVING without a target")
        assert health(orchestrator.address, LIVENESS) == SERVING
        stack.target = start_target(stack, "target-after-the-wait")
        again = generate(orchestrator.address, input_ids=PROMPTS[0], max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert again.token_ids == stack.expected[0]
    assert_nothing_held(stack.target_address, [stack.draft.address])


def test_health_clocks_a_stall_from_when_work_arrives(stack: Stack) -> None:
    """An orchestrator idle past its stall bound is SERVING when work arrives; holding that work without a step (its
    target stopped) makes it NOT_SERVING once the bound has passed since the arrival, not at once."""
    bound = 3.0
    command = orchestrator_command(stack.model, stack.draft, stack.target_address, "--stall-timeout", str(bound))
    with service("orchestrator-stall-bound", command, stack.workdir) as orchestrator:
        generate(orchestrator.address, input_ids=PROMPTS[0], max_new_tokens=4, ignore_eos=True)
        time.sleep(bound + 1.5)  # idle past the bound: its last step is that old when the next request arrives
        stack.target.process.send_signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                arrived = time.monotonic()
                waiting = pool.submit(
                    generate, orchestrator.address, input_ids=PROMPTS[0], max_new_tokens=4, ignore_eos=True
                )
                wait_for(lambda: health(orchestrator.address, "") == NOT_SERVING, "NOT_SERVING while stalled")
                stalled_after = time.monotonic() - arrived
                stack.target.process.send_signal(signal.SIGCONT)
                assert waiting.result().token_ids == stack.expected[0][:4]
        finally:
            stack.target.process.send_signal(signal.SIGCONT)
        # Health is polled every second: NOT_SERVING comes within a second after the bound, and not before it.
        assert bound - 0.5 <= stalled_after <= bound + 3.0, stalled_after
        wait_for(lambda: health(orchestrator.address, "") == SERVING, "SERVING once it steps again")


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        status: int = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
        return status


def generate_drafts(address: str) -> int:
    """Draft tokens one short speculative request was given."""
    return generate(address, input_ids=PROMPTS[0], max_new_tokens=8, ignore_eos=True).stats.draft_tokens


def child_pid(stack: ServeProcess, service_name: str) -> int:
    """The pid of the serve process's child running `tandem <service_name>`."""
    found = child_pids(stack, service_name)
    assert len(found) == 1, found
    return found[0]


def child_pids(stack: ServeProcess, service_name: str) -> list[int]:
    found = []
    for child in psutil.Process(stack.process.pid).children(recursive=True):
        try:
            if child.cmdline()[3:4] == [service_name] and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)  # python -m launch.cli <service_name> ...
        except psutil.Error:  # gone meanwhile
            continue
    return found


def test_tandem_serve_starts_a_killed_target_and_replica_again_at_their_addresses(
    llama_target: Path, random_draft: Path
) -> None:
    with serve(llama_target, random_draft, "--speculative-num-steps", "3", *REPROBE) as served:
        expected = target_only(served.address)
        target = child_pid(served, "target")
        streams = streams_through(served.address, lambda: os.kill(target, signal.SIGKILL))
        assert_streams_whole(streams, expected)
        assert child_pid(served, "target") != target
        assert any(re.search(r"target exited with code -9 after .* starting it again", line) for line in served.log)
        replica = child_pid(served, "draft")
        os.kill(replica, signal.SIGKILL)
        wait_for(lambda: child_pids(served, "draft") not in ([], [replica]), "the replica started again")
        wait_for(lambda: generate_drafts(served.address) > 0, "the restarted replica drafts")
        assert served.process.poll() is None
