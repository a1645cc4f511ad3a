"""The stack `tandem bench-faults` breaks: a target, one draft replica and an orchestrator, each `tandem` service in a
process of its own at a fixed port (so that one killed can be started again where it was), and a TCP fault proxy
(bench.fault_proxy) on each of the three links. Every service's output is kept with the time each line came.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.fault_proxy import FaultProxy

LINKS = ("orchestrator-target", "orchestrator-replica", "replica-target")
READY_TIMEOUT_S = 120.0
# What the stack runs with beside --keepalive-timeout, written into the report: small KV blocks and a 1 s orphan
# timeout so that what a fault leaves held is let go soon, a fixed k so that each scenario drafts alike.
CACHE_FLAGS = ("--block-size", "8", "--orphan-timeout", "1")
ORCHESTRATOR_FLAGS = (
    "--speculative-num-steps",
    "3",
    "--no-adaptive-k",
    "--target-timeout",
    "30",
    "--draft-timeout",
    "2",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Service:
    """One `tandem` service process; `lines` holds (time.monotonic(), line) of its output."""

    name: str
    command: list[str]
    port: int
    process: subprocess.Popen[str] | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, workdir: Path) -> None:
        """Starts it and returns once it serves; raises RuntimeError with its output when it does not."""
        ready_file = workdir / f"{self.name}.address"
        ready_file.unlink(missing_ok=True)
        command = [*self.command, "--port", str(self.port), "--ready-file", str(ready_file)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.process = process
        threading.Thread(target=self._read, args=(process,), daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start:\n{''.join(line for _, line in self.lines)}")
            time.sleep(0.05)

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in iter(process.stdout.readline, ""):
            self.lines.append((time.monotonic(), line))

    def signal(self, signum: int) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM (after SIGCONT: a scenario may have paused it), SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None


def tandem(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *arguments]


@dataclass
class FaultStack:
    """The three services and the three proxies; close() stops them all."""

    target_dir: Path
    draft_dir: Path
    keepalive_timeout_s: float
    workdir: tempfile.TemporaryDirectory[str] = field(default_factory=lambda: tempfile.TemporaryDirectory())
    services: dict[str, Service] = field(default_factory=dict)  # target, draft, orchestrator
    proxies: dict[str, FaultProxy] = field(default_factory=dict)  # by link

    def start(self) -> FaultStack:
        keepalive = ("--keepalive-timeout", str(self.keepalive_timeout_s))
        ports = {name: free_port() for name in ("target", "draft", "orchestrator")}
        target = f"127.0.0.1:{ports['target']}"
        draft = f"127.0.0.1:{ports['draft']}"
        self.proxies = {
            "orchestrator-target": FaultProxy(target),
            "replica-target": FaultProxy(target),
            "orchestrator-replica": FaultProxy(draft),
        }
        draft_command = ["--model", str(self.draft_dir), "--target-address", self.proxies["replica-target"].address]
        draft_command += ["--replica-id", "draft-0", "--speculative-num-steps", "3"]
        orchestrator_command = ["--target-address", self.proxies["orchestrator-target"].address]
        orchestrator_command += ["--tokenizer", str(self.target_dir), "--admin-port", "0"]
        orchestrator_command += ["--draft-address", self.proxies["orchestrator-replica"].address]
        commands = {
            "target": tandem("target", "--model", str(self.target_dir), *CACHE_FLAGS, *keepalive),
            "draft": tandem("draft", *draft_command, *CACHE_FLAGS, *keepalive),
            "orchestrator": tandem("orchestrator", *orchestrator_command, *ORCHESTRATOR_FLAGS, *keepalive),
        }
        for name, command in commands.items():
            self.services[name] = Service(name, command, ports[name])
            self.services[name].start(Path(self.workdir.name))
        return self

    def restart(self, name: str) -> None:
        """Kills a service (SIGKILL) and starts it again at its address."""
        self.services[name].kill()
        self.services[name].start(Path(self.workdir.name))

    def pause(self, name: str, seconds: float) -> None:
        self.services[name].signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.services[name].signal(signal.SIGCONT)

    def address(self, name: str) -> str:
        return self.services[name].address

    def logged_since(self, moment: float) -> Sequence[tuple[float, str, str]]:
        """(time, service, line) of every line logged at or after `moment`, in time order."""
        found = [(at, name, line) for name, s in self.services.items() for at, line in s.lines if at >= moment]
        return sorted(found)

    def close(self) -> None:
        for service in reversed(self.services.values()):
            service.stop()
        for proxy in self.proxies.values():
            proxy.close()
        self.workdir.cleanup()
