"""The stack `tandem bench-faults` breaks: a target, one draft replica and two orchestrators (the second takes the
streams of the first when it dies), each `tandem` service in a process of its own at a fixed port (so that one killed
can be started again where it was), and a TCP fault proxy (bench.fault_proxy) on each of the three links, which both
orchestrators share. Every service's output is kept with the time each line came.
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
# timeout so that what a fault leaves held is let go soon, a fixed k so that each scenario drafts alike, and a demoted
# replica probed again every 0.5 s so that it drafts again soon after its fault ends.
CACHE_FLAGS = ("--block-size", "8", "--orphan-timeout", "1")
SHORT_SHUTDOWN_S = 0.5  # the second orchestrator's --shutdown-timeout: streams of 32 tokens are still running then
ORCHESTRATOR_FLAGS = (
    "--speculative-num-steps",
    "3",
    "--no-adaptive-k",
    "--target-timeout",
    "30",
    "--draft-timeout",
    "2",
    "--reprobe-max-interval",
    "0.5",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class Signalled:
    """What a fault saw of the service it signalled, in seconds after the signal: its exit code and when it exited,
    when it served again (started again where it was), and after a SIGTERM, when it refused a new request."""

    exit_code: int | None
    exit_s: float
    back_s: float
    refused_s: float | None = None


@dataclass
class Service:
    """One `tandem` service process; `lines` holds (time.monotonic(), line) of its output. `extra` flags go to its
    next start."""

    name: str
    command: list[str]
    port: int
    process: subprocess.Popen[str] | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    extra: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, workdir: Path) -> None:
        """Starts it and returns once it serves; raises RuntimeError with its output when it does not."""
        self.launch(workdir)
        self.wait_ready(workdir)

    def launch(self, workdir: Path) -> None:
        """Starts the process (wait_ready waits until it serves)."""
        ready_file = workdir / f"{self.name}.address"
        ready_file.unlink(missing_ok=True)
        command = [*self.command, *self.extra, "--port", str(self.port), "--ready-file", str(ready_file)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.process = process
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def wait_ready(self, workdir: Path) -> None:
        assert self.process is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (workdir / f"{self.name}.address").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
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

    def kill(self) -> int:
        """SIGKILL; returns the exit code."""
        assert self.process is not None
        self.process.kill()
        return self.process.wait()

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
        ports = {name: free_port() for name in ("target", "draft", "orchestrator", "orchestrator-2")}
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
        # The second drains in SHORT_SHUTDOWN_S: the short drain's streams go to it.
        commands["orchestrator-2"] = [*commands["orchestrator"], "--shutdown-timeout", str(SHORT_SHUTDOWN_S)]
        workdir = Path(self.workdir.name)
        for name, command in commands.items():  # all at once: the others wait for the target's health themselves
            self.services[name] = Service(name, command, ports[name])
            self.services[name].launch(workdir)
        for service in self.services.values():
            service.wait_ready(workdir)
        return self

    def restart(self, name: str, *extra: str) -> Signalled:
        """Kills a service (SIGKILL) and starts it again at its address, with `extra` flags."""
        began = time.monotonic()
        exit_code = self.services[name].kill()
        return Signalled(exit_code, time.monotonic() - began, self.start_again(name, *extra, began=began))

    def start_again(self, name: str, *extra: str, began: float) -> float:
        """Starts a service that exited again at its address, with `extra` flags; returns the seconds since `began`."""
        service = self.services[name]
        service.extra = extra
        service.start(Path(self.workdir.name))
        return time.monotonic() - began

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
