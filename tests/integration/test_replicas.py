"""Draft replicas fail and join without costing a request; greedy outputs stay equal to target-only."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import Stack, draft_info, generate, serve, service_addresses, tandem_command

PROMPTS = [f"def function_{index}(value):\n    return" for index in range(16)]
# Long enough that the streams still run when the replicas change: a newcomer joins 1.5 s into 4 streams of
# JOIN_TOKENS; the scale-down drains the second wave of SCALE_TOKENS, sent just before it.
JOIN_TOKENS = 400  # 200 let all four end before the switch in a CI run (assert switched_back > 0 failed)
SCALE_TOKENS = 120


def replica_pid(stack: Stack, replica_id: str) -> int:
    """The pid of this stack's `tandem draft --replica-id REPLICA_ID` process: one of the serve process's children,
    so that another stack on the machine (a parallel test run) with a replica of the same name is never taken."""
    pids = []
    for child in psutil.Process(stack.process.pid).children(recursive=True):
        try:
            arguments = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        flag = arguments.index("--replica-id") if "--replica-id" in arguments else -1
        if "draft" in arguments and flag >= 0 and arguments[flag + 1] == replica_id:
            pids.append(child.pid)
    assert len(pids) == 1, f"expected one process for {replica_id}, found {pids}"
    return pids[0]


def admin(stack: Stack) -> orchestrator_pb2_grpc.OrchestratorAdminStub:
    """OrchestratorAdmin of a running stack, on its own port (loopback, no token)."""
    assert stack.admin_address is not None
    channel = grpc.insecure_channel(stack.admin_address, options=channel_options())
    return orchestrator_pb2_grpc.OrchestratorAdminStub(channel)


def greedy(address: str, prompt: str, max_new_tokens: int, disable_speculation: bool = False) -> list[int]:
    completion = generate(
        address, prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=True, disable_speculation=disable_speculation
    )
    assert completion.finish_reason == "length"
    return completion.token_ids


def target_only(address: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """The prompts' target-only greedy outputs, all at once (greedy output does not depend on the batch)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: greedy(address, prompt, max_new_tokens, True), prompts))


References = dict[tuple[tuple[str, ...], int], list[list[int]]]


@pytest.fixture(scope="module")
def references() -> References:
    """Target-only greedy outputs by (prompts, max_new_tokens), taken once through the first stack that asks: they
    depend on the target alone, not on a stack's replicas or flags."""
    return {}


def reference(references: References, address: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    key = (tuple(prompts), max_new_tokens)
    if key not in references:
        references[key] = target_only(address, prompts, max_new_tokens)
    return references[key]


def test_sigkilled_replica_costs_no_request(llama_target: Path, random_draft: Path, references: References) -> None:
    # A demoted replica is probed again every 0.5 s: it serves again soon after its restart.
    arguments = ("--draft-replicas", "2", "--speculative-num-steps", "3", "--reprobe-max-interval", "0.5")
    with serve(llama_target, random_draft, *arguments) as stack:
        replicas = admin(stack).ListReplicas(orchestrator_pb2.ListReplicasRequest()).replicas
        assert sorted(r.replica_id for r in replicas) == ["draft-0", "draft-1"]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(greedy, stack.address, prompt, 120) for prompt in PROMPTS]
            time.sleep(1.0)  # the streams are running
            killed = replica_pid(stack, "draft-1")
            os.kill(killed, signal.SIGKILL)
            speculative = [future.result(timeout=300) for future in futures]
        # The dead replica is demoted and probed until it answers: `tandem serve` starts it again at its address.
        assert any("draft replica draft-1 demoted" in line for line in stack.log)

        def states() -> list[tuple[str, str, int]]:
            replicas = admin(stack).ListReplicas(orchestrator_pb2.ListReplicasRequest()).replicas
            return sorted((r.replica_id, r.state, r.outstanding) for r in replicas)

        deadline = time.monotonic() + 60
        while states() != [("draft-0", "serving", 0), ("draft-1", "serving", 0)]:
            assert time.monotonic() < deadline, (states(), [line for line in stack.log if "draft-1" in line])
            time.sleep(0.1)
        assert replica_pid(stack, "draft-1") != killed
        expected = reference(references, stack.address, PROMPTS, 120)
    assert speculative == expected


def test_last_replica_lost_then_a_new_one_joins(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    with serve(llama_target, random_draft, "--speculative-num-steps", "3") as stack:
        target_address = service_addresses(stack.log)["target"]
        ready_file = tmp_path / "new-draft.address"
        arguments = ["draft", "--model", str(random_draft), "--target-address", target_address]
        arguments += ["--replica-id", "draft-new", "--port", "0", "--ready-file", str(ready_file)]
        newcomer = subprocess.Popen(tandem_command(*arguments))
        try:
            deadline = time.monotonic() + 120
            while not ready_file.exists():
                assert newcomer.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            new_address = ready_file.read_text()
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(greedy, stack.address, prompt, JOIN_TOKENS) for prompt in PROMPTS[:4]]
                time.sleep(1.0)
                os.kill(replica_pid(stack, "draft-0"), signal.SIGKILL)
                time.sleep(0.5)  # the running requests go on target-only
                status = admin(stack).AddReplica(orchestrator_pb2.AddReplicaRequest(address=new_address))
                assert (status.replica_id, status.state) == ("draft-new", "serving")
                # The running requests switch back to speculation on the newcomer.
                deadline = time.monotonic() + 60
                while draft_info(new_address).running_requests == 0 and not all(f.done() for f in futures):
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                switched_back = draft_info(new_address).running_requests
                speculative = [future.result(timeout=300) for future in futures]
            assert switched_back > 0
            assert speculative == target_only(stack.address, PROMPTS[:4], JOIN_TOKENS)
            # New requests use the newcomer too.
            completion = generate(stack.address, prompt="def x():", max_new_tokens=20, ignore_eos=True)
            assert completion.stats.draft_tokens > 0
        finally:
            newcomer.send_signal(signal.SIGTERM)
            newcomer.wait(timeout=60)


def test_scale_1_to_3_to_1_under_16_streams(llama_target: Path, random_draft: Path, references: References) -> None:
    first_wave, second_wave = PROMPTS[:8], PROMPTS[8:]
    with serve(llama_target, random_draft, "--speculative-num-steps", "3") as stack:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(greedy, stack.address, prompt, SCALE_TOKENS) for prompt in first_wave]
            up = subprocess.run(
                tandem_command("scale", "--draft-replicas", "3", "--address", str(stack.admin_address)),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert up.returncode == 0, up.stderr
            assert sorted(line.split("\t")[0] for line in up.stdout.splitlines()) == ["draft-0", "draft-1", "draft-2"]
            # New requests go to the least loaded replicas: the new ones.
            futures += [pool.submit(greedy, stack.address, prompt, SCALE_TOKENS) for prompt in second_wave]
            deadline = time.monotonic() + 60
            while True:
                replicas = admin(stack).ListReplicas(orchestrator_pb2.ListReplicasRequest()).replicas
                new_load = sum(r.outstanding for r in replicas if r.replica_id != "draft-0")
                if new_load > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert new_load > 0
            # The same through the admin RPC: back to one replica; the others drain their requests first.
            assert not all(future.done() for future in futures), "no stream left to drain"
            admin(stack).Scale(orchestrator_pb2.ScaleRequest(draft_replicas=1), timeout=300)
            speculative = [future.result(timeout=300) for future in futures]
        replicas = admin(stack).ListReplicas(orchestrator_pb2.ListReplicasRequest()).replicas
        assert [r.replica_id for r in replicas] == ["draft-0"]
        expected = reference(references, stack.address, PROMPTS, SCALE_TOKENS)
        # Scaled down, the stack still serves (the reference may come from the first test's stack).
        assert greedy(stack.address, PROMPTS[0], SCALE_TOKENS) == expected[0]
        assert not any("exited with code" in line for line in stack.log)
    assert speculative == expected
