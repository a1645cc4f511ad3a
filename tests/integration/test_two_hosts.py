"""The stack across two hosts: two network namespaces joined by a veth pair (10.77.x.1 and 10.77.x.2, addresses that
exist only inside the namespaces made here), a Ray head on one and a Ray worker on the other, and `tandem serve
--launcher ray` joining them from the first. With a CPU a host, the target lands on one host and both draft replicas on
the other, each service bound to its own host's address. Then a partition between the hosts (a blackhole route each way:
packets vanish, connections stay open) under a stream in flight, and its healing: the stream ends with the tokens of a
run without the fault, no service is restarted, and after the healing the replicas draft again.

Needs root (network namespaces), as CI has; elsewhere it is skipped, saying why.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180.0
SERVING = re.compile(r"tandem serve: (\S+) serving on (\S+):\d+ \(Ray actor")
STATS = re.compile(r"draft_tokens=(\d+)")
TOKENS = ("--max-new-tokens", "128")
PARTITION_S = 3.0  # three keepalive timeouts (--keepalive-timeout 1)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for network namespaces"
)


@dataclass
class Host:
    namespace: str
    address: str
    peer: str  # the other host's address

    def command(self, *arguments: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *arguments]

    def partition(self, on: bool) -> None:
        """Packets to the other host vanish (on) or flow again (off)."""
        verb = "add" if on else "del"
        subprocess.run(["ip", "-n", self.namespace, "route", verb, "blackhole", f"{self.peer}/32"], check=True)


@dataclass
class Process:
    """A process in a namespace, its own session (stopped with its children), its output kept line by line."""

    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert self.popen.stdout is not None
        stdout = self.popen.stdout
        threading.Thread(target=lambda: self.lines.extend(iter(stdout.readline, "")), daemon=True).start()

    def wait_for(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(pattern in line for line in list(self.lines)):
            assert self.popen.poll() is None and time.monotonic() < deadline, "".join(self.lines[-30:])
            time.sleep(0.2)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair; removed (with everything left in them) at the end."""
    tag = f"{os.getpid() % 100_000}"
    subnet = f"10.77.{os.getpid() % 250}"
    a, b = Host(f"tandem-a{tag}", f"{subnet}.1", f"{subnet}.2"), Host(f"tandem-b{tag}", f"{subnet}.2", f"{subnet}.1")
    ends = (f"tva{tag}", f"tvb{tag}")
    try:
        for host in (a, b):
            subprocess.run(["ip", "netns", "add", host.namespace], check=True)
        subprocess.run(["ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1]], check=True)
        for host, end in zip((a, b), ends, strict=True):
            subprocess.run(["ip", "link", "set", end, "netns", host.namespace], check=True)
            subprocess.run(["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", end], check=True)
            for device in (end, "lo"):
                subprocess.run(["ip", "-n", host.namespace, "link", "set", device, "up"], check=True)
        yield a, b
    finally:
        for host in (a, b):
            subprocess.run(["ip", "netns", "del", host.namespace], check=False)


def start(host: Host, arguments: Sequence[str], environment: dict[str, str]) -> Process:
    popen = subprocess.Popen(
        host.command(*arguments),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
        cwd=ROOT,
        start_new_session=True,
    )
    return Process(popen)


def generate(host: Host, address: str, *flags: str) -> tuple[str, int]:
    """`tandem generate` from inside a host: the completion's text and its draft tokens."""
    command = [
        sys.executable,
        "-m",
        "launch.cli",
        "generate",
        "--address",
        address,
        "--ignore-eos",
        *flags,
        "def f(x):",
    ]
    done = subprocess.run(host.command(*command), capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    text, _, stats = done.stdout.rpartition("[finish_reason=")
    match = STATS.search(stats)
    assert match is not None, done.stdout + done.stderr
    return text, int(match.group(1))


def stream_through_partition(a: Host, b: Host, address: str) -> tuple[list[tuple[str, int]], list[BaseException]]:
    """Generates from host a while the two hosts are cut apart for PARTITION_S; the answer, or what it raised."""
    in_flight: list[tuple[str, int]] = []
    failures: list[BaseException] = []

    def read() -> None:
        try:
            in_flight.append(generate(a, address, *TOKENS))
        except BaseException as error:  # reported by the caller
            failures.append(error)

    stream = threading.Thread(target=read)
    stream.start()
    time.sleep(1.5)  # the generate command has started and sent its request
    for host in (a, b):
        host.partition(on=True)
    time.sleep(PARTITION_S)
    for host in (a, b):
        host.partition(on=False)
    stream.join(timeout=180)
    return in_flight, failures


def test_the_stack_spans_two_hosts_and_a_partition_between_them_costs_only_drafts() -> None:
    # Ray clusters started by `ray start` ask for a token: every process of this cluster gets the same one. Ray's
    # own node health check may miss 20 beats (60 s) before it declares a host dead: the partition here is Tandem's
    # to survive, not Ray's.
    environment = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    environment["RAY_health_check_failure_threshold"] = "20"
    # Stopped, each host's processes take SIGTERM together: a node that would first ask its GCS to drain it waits
    # for that GCS, gone too, for 30 s (Ray's default). Without the drain, the head stops in about a second.
    nodes = {**environment, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1", "--num-gpus", "0"]
    # Short: Ray's unix socket paths under it must stay within 107 characters.
    temp = Path(tempfile.mkdtemp(prefix="tandem-ray-"))
    with two_hosts() as (a, b), ExitStack() as processes:
        processes.callback(shutil.rmtree, temp, True)
        head = start(a, [*ray, "--head", "--node-ip-address", a.address, "--port", "6390",
                         "--include-dashboard", "false", "--temp-dir", str(temp / "a")], nodes)  # fmt: skip
        processes.callback(head.stop)
        head.wait_for("Ray runtime started")
        worker = start(b, [*ray, "--address", f"{a.address}:6390", "--node-ip-address", b.address,
                           "--temp-dir", str(temp / "b")], nodes)  # fmt: skip
        processes.callback(worker.stop)
        worker.wait_for("Ray runtime started")
        # One CPU a host: the target's bundle takes one, the two replicas (half a CPU each) the other.
        serve = start(a, [sys.executable, "-m", "launch.cli", "serve", "--launcher", "ray", "--ray-address",
                          f"{a.address}:6390", "--host", a.address, "--port", "0", "--no-http",
                          "--draft-replicas", "2", "--keepalive-timeout", "1", "--reprobe-max-interval", "0.5"],
                         environment)  # fmt: skip
        processes.callback(serve.stop)
        serve.wait_for("tandem ready: Generate on")
        hosts = {m.group(1): m.group(2) for m in map(SERVING.search, serve.lines) if m}
        assert set(hosts) == {"target", "draft-0", "draft-1", "orchestrator"}, hosts
        # The orchestrator runs where `tandem serve` does; target and replicas on different hosts, each at its own.
        assert hosts["orchestrator"] == a.address and hosts["draft-0"] == hosts["draft-1"]
        assert {hosts["target"], hosts["draft-0"]} == {a.address, b.address}
        address = next(line for line in serve.lines if "tandem ready" in line).split()[4]

        expected, _ = generate(a, address, *TOKENS, "--no-speculation")
        text, drafted = generate(a, address, *TOKENS)
        assert (text, drafted > 0) == (expected, True)

        # A partition of PARTITION_S while a stream runs: past the keepalive timeout, so the replicas are dropped
        # (and the target too, where it is on the other host: the stream then waits for it).
        in_flight, failures = stream_through_partition(a, b, address)
        assert not failures and in_flight[0][0] == expected, (failures, "".join(serve.lines[-30:]))
        # Healed: a demoted replica is probed again (every 0.5 s: --reprobe-max-interval) and rejoins.
        deadline = time.monotonic() + 90
        while (again := generate(a, address, *TOKENS))[1] == 0:
            assert time.monotonic() < deadline, "".join(serve.lines[-30:])
            time.sleep(1.0)
        assert again[0] == expected
        assert not any("starting it again" in line for line in serve.lines)  # the partition killed no service
