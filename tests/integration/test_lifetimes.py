"""No process of a stack outlives a SIGKILLed `tandem serve`, though nothing is left to stop them in order.

The kernel sends each child SIGTERM when its parent dies (tandem.lifetime), and each service then stops as it does
on a process manager's SIGTERM, stopping its own children.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import serve

GONE_TIMEOUT_S = 20.0
LOG_TIMEOUT_S = 5.0  # for the last lines of the stopped services to pass through the output pump


@dataclass(frozen=True)
class Process:
    pid: int
    start_time: str  # since boot: tells this process from a later one given the same pid
    name: str  # command_name of its arguments


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on, None once the pid is gone; fields 1-2 end at the last ')'."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def command_name(arguments: list[str]) -> str:
    """The module a Python process runs, with the command for launch.cli: "launch.cli draft", "target_server.rank"."""
    if "-m" not in arguments:
        return arguments[0]
    module = arguments[arguments.index("-m") + 1]
    return f"{module} {arguments[arguments.index(module) + 1]}" if module == "launch.cli" else module


def descendants(root: int) -> list[Process]:
    """Every process below `root`, found through the parent pids in /proc."""
    children: dict[int, list[Process]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        try:
            arguments = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        if fields is None:
            continue
        process = Process(int(entry.name), fields[19], command_name(arguments))
        children.setdefault(int(fields[1]), []).append(process)
    found, parents = [], [root]
    while parents:
        below = children.get(parents.pop(), [])
        found += below
        parents += [process.pid for process in below]
    return found


def is_running(process: Process) -> bool:
    """False once the process is gone or a zombie (exited, not yet reaped by whoever adopted it)."""
    fields = stat_fields(process.pid)
    return fields is not None and fields[19] == process.start_time and fields[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_every_process_ends_with_a_sigkilled_serve(llama_target: Path, random_draft: Path) -> None:
    """Children started every way there is: services from the launcher's main thread, a draft replica from a gRPC
    worker thread of its Scaler (Scale to 2 replicas), a target rank from the target's model thread (tp 2)."""
    with serve(llama_target, random_draft, "--tp", "2", "--speculative-num-steps", "3") as stack:
        assert stack.admin_address is not None
        with grpc.insecure_channel(stack.admin_address, options=channel_options()) as channel:
            admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
            admin.Scale(orchestrator_pb2.ScaleRequest(draft_replicas=2), timeout=300)
        processes = descendants(stack.process.pid)
        try:
            assert sorted(process.name for process in processes) == [
                "launch.cli draft",
                "launch.cli draft",
                "launch.cli orchestrator",
                "launch.cli target",
                "target_server.rank",
            ]
            stack.process.send_signal(signal.SIGKILL)
            stack.process.wait()
            killed = time.monotonic()
            ended = wait_until(lambda: not any(is_running(process) for process in processes), GONE_TIMEOUT_S)
            left = [process for process in processes if is_running(process)]
            assert ended, f"still running {GONE_TIMEOUT_S:.0f} s after tandem serve was killed: {left}"
            print(f"every process ended {time.monotonic() - killed:.1f} s after tandem serve was killed")
        finally:
            for process in processes:
                if is_running(process):
                    os.kill(process.pid, signal.SIGKILL)
        # Each service ran its own stop, as on a process manager's SIGTERM; the target's stopped its rank in order.
        expected = ["target stopping", "orchestrator stopping", "draft draft-0 stopping", "draft draft-1 stopping"]
        expected.append("rank 1/2: stopped by rank 0")
        logged = wait_until(lambda: all(any(line in entry for entry in stack.log) for line in expected), LOG_TIMEOUT_S)
        assert logged, "".join(stack.log)


TOOL = """
import sys
from launch.processes import ServeProcess
stack = ServeProcess(sys.argv[1:])
print(stack.process.pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_stack_started_by_a_tool_ends_with_the_tool(llama_target: Path, random_draft: Path) -> None:
    """`tandem bench` and the load test start their stack through ServeProcess: killed (SIGKILL, or the OOM killer),
    they leave no stack behind."""
    arguments = ["--target", str(llama_target), "--draft", str(random_draft), "--port", "0", "--no-http"]
    tool = subprocess.Popen(
        [sys.executable, "-c", TOOL, *arguments], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    processes: list[Process] = []
    try:
        assert tool.stdout is not None
        serve_pid = int(tool.stdout.readline())
        processes = descendants(tool.pid)
        assert serve_pid in {process.pid for process in processes}
        assert sorted(process.name for process in processes) == [
            "launch.cli draft",
            "launch.cli orchestrator",
            "launch.cli serve",
            "launch.cli target",
        ]
        tool.kill()
        tool.wait()
        ended = wait_until(lambda: not any(is_running(process) for process in processes), GONE_TIMEOUT_S)
        left = [process for process in processes if is_running(process)]
        assert ended, f"still running {GONE_TIMEOUT_S:.0f} s after the tool was killed: {left}"
    finally:
        tool.kill()
        tool.wait()
        for process in processes:
            if is_running(process):
                os.kill(process.pid, signal.SIGKILL)
