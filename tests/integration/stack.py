"""Starts Tandem the way users do (the `tandem` command in child processes) and talks to it over gRPC."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from launch.processes import ServeProcess
from tandem.grpc_util import channel_options
from tandem.settings import DEMO_CHAT_TEMPLATE
from tandem.wire import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

READY_TIMEOUT_S = 180.0
READY_LINE = re.compile(r"tandem ready: Generate on (\S+)")
# The flags of the stacks several modules share (SharedStacks): the demo pair's HTTP API with its chat template, and
# the tree shape the tree, hybrid and structured-output tests draft with.
DEMO_HTTP = ("--http-port", "0", "--chat-template", str(DEMO_CHAT_TEMPLATE))
TREE = ("--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3")


def tandem_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *arguments]


Stack = ServeProcess


@contextmanager
def serve(target: Path, draft: Path | None, *extra: str) -> Iterator[ServeProcess]:
    """`tandem serve` on free ports (public and admin); yields once the ready line is printed, stops it afterwards.

    k is fixed (--no-adaptive-k) unless `extra` says otherwise: the tests' random drafts are rarely accepted, so the
    adaptive choice would soon stop drafting, and the tests are about what drafting does.
    """
    stack = start(target, draft, *extra)
    try:
        yield stack
    finally:
        stack.stop()


def start(target: Path, draft: Path | None, *extra: str) -> ServeProcess:
    """`serve` without the context: the caller stops the stack."""
    fixed_k = [] if any(option.endswith("adaptive-k") for option in extra) else ["--no-adaptive-k"]
    arguments = ["--target", str(target), "--port", "0", "--admin-port", "0", *fixed_k, *extra]
    if draft is not None:
        arguments += ["--draft", str(draft)]
    return ServeProcess(arguments, ready_timeout_s=READY_TIMEOUT_S)


class SharedStacks:
    """`tandem serve` stacks shared by every test that needs the same (target, draft, flags), started on first use.

    The tests that share a stack use their own requests and check their own results; a test that kills, scales or
    breaks a stack starts its own with `serve`. At most `capacity` stay running (each is four processes, about
    1.3 GB); the least recently used one is stopped to make room, and started again if asked for later. Tests that
    share stacks run on one pytest-xdist worker, one module after another (RUN_WITH in tests/conftest.py).
    """

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._running: OrderedDict[tuple[str, ...], ServeProcess] = OrderedDict()

    def get(self, target: Path, draft: Path | None, *extra: str) -> ServeProcess:
        key = (str(target), str(draft), *extra)
        stack = self._running.get(key)
        if stack is not None and stack.process.poll() is not None:
            raise RuntimeError(f"a shared stack exited with code {stack.process.returncode}:\n{''.join(stack.log)}")
        if stack is None:
            while len(self._running) >= self.capacity:
                self._running.popitem(last=False)[1].stop()
            stack = self._running[key] = start(target, draft, *extra)
        self._running.move_to_end(key)
        return stack

    def stop(self) -> None:
        while self._running:
            self._running.popitem()[1].stop()


def run_to_exit(arguments: Sequence[str], timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """Runs a tandem command expected to stop on its own (a start-up failure); stdout and stderr merged."""
    return subprocess.run(
        tandem_command(*arguments), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s
    )


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: orchestrator_pb2.GenerateStats
    messages: int
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # when the request asked for them


def generate(address: str, **fields: object) -> Completion:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        token_ids: list[int] = []
        text = []
        logprobs: list[common_pb2.TokenLogprob] = []
        stream = stub.Generate(orchestrator_pb2.GenerateRequest(**fields), timeout=300)  # type: ignore[arg-type]
        for count, response in enumerate(stream, start=1):
            token_ids.extend(response.token_ids)
            text.append(response.text)
            logprobs.extend(response.logprobs)
            if response.finish_reason:
                return Completion(token_ids, "".join(text), response.finish_reason, response.stats, count, logprobs)
    raise AssertionError("stream ended without a finish_reason")


def target_info(address: str) -> target_pb2.TargetInfo:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        info: target_pb2.TargetInfo = target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest())
        return info


def draft_info(address: str) -> draft_pb2.DraftInfo:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        info: draft_pb2.DraftInfo = draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.DraftInfoRequest())
        return info


def service_addresses(log: Sequence[str]) -> dict[str, str]:
    """The internal addresses the services logged ("target serving on host:port")."""
    found = {}
    for line in log:
        if match := re.search(r" (target|draft|orchestrator)\S* INFO tandem\.serving: .* serving on (\S+)", line):
            found[match.group(1)] = match.group(2)
    return found


@dataclass
class TargetProcess:
    address: str
    process: subprocess.Popen[str]


@contextmanager
def target_process(model: Path, tp: int, ready_file: Path, *flags: str) -> Iterator[TargetProcess]:
    """`tandem target` alone (with `flags`), on a free port; yields its address and process once it serves."""
    command = tandem_command("target", "--model", str(model), "--tp", str(tp), "--port", "0", *flags)
    process = subprocess.Popen(
        [*command, "--ready-file", str(ready_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"tandem target did not start:\n{process.communicate()[0]}")
            time.sleep(0.1)
        yield TargetProcess(ready_file.read_text().strip(), process)
    finally:
        process.terminate()
        process.wait(timeout=60)


@dataclass
class Service:
    name: str
    address: str
    process: subprocess.Popen[str]
    log: list[str]


@contextmanager
def service(name: str, arguments: list[str], workdir: Path) -> Iterator[Service]:
    """One command (a `tandem` service or a test helper module) in its own process, given `--ready-file`; yields
    once the file exists. Its output is collected in `log`; a process a test stopped (SIGSTOP) is resumed and
    terminated at the end."""
    ready_file = workdir / f"{name}.address"
    ready_file.unlink(missing_ok=True)
    command = [*arguments, "--ready-file", str(ready_file)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    assert process.stdout is not None
    stdout = process.stdout
    threading.Thread(target=lambda: log.extend(iter(stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise RuntimeError(f"{name} did not start:\n{''.join(log)}")
            time.sleep(0.1)
        yield Service(name, ready_file.read_text().strip(), process, log)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)  # a test may have stopped it
            process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
