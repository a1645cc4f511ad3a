"""`tandem serve --launcher process`: the three services as child processes on loopback.

Each child binds a free port and writes its address to a ready file; the launcher passes addresses
on, prints one `ready` line when Generate is servable, and stops the children (orchestrator, drafts,
target) on SIGINT or SIGTERM. A child that exits during start-up stops everything with its exit code; one that dies
later is started again at its address, with backoff (launch/restarts.py). Children end with the launcher however it
ends: killed, it leaves them SIGTERM from the kernel (tandem.lifetime).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import grpc

from draft_server.settings import DraftSettings
from launch.restarts import Child
from launch.serve_settings import ServeSettings
from launch.stack_security import StackSecurity, without_secrets
from tandem import flags
from tandem.devices import DeviceRequest
from tandem.grpc_util import channel_options
from tandem.lifetime import start_child
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from target_server.settings import TargetSettings

STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 15.0


def stop_timeout_s(name: str, shutdown_timeout_s: float) -> float:
    """How long a service may take to stop after SIGTERM: the orchestrator drains its streams first."""
    return STOP_TIMEOUT_S + (shutdown_timeout_s if name == "orchestrator" else 0.0)


def service_arguments(command: str, settings: TargetSettings | DraftSettings) -> list[str]:
    """`tandem target|draft` with these settings: their options, and the resolved devices as a request."""
    device = DeviceRequest.of(settings.device, settings.dtype, settings.cache)
    return [command, *flags.arguments_of(settings), *flags.arguments_of(device)]


class ChildFailed(RuntimeError):
    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name} exited with code {returncode} during start-up (its log is above)")
        self.returncode = returncode


class Interrupted(RuntimeError):
    """A signal arrived before every service was ready."""


class Launcher:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.children: list[Child] = []
        self._workdir = tempfile.TemporaryDirectory(prefix="tandem-serve-")
        self._stopping = False
        self._replica_ids = itertools.count()
        self._scale_lock = threading.Lock()
        self._target_address = ""
        self._orchestrator_address = ""
        self.admin_address = ""
        self.http_url = ""  # the orchestrator's HTTP API, once started with one
        self._scaler: grpc.Server | None = None
        self._security: StackSecurity | None = None

    def start(self) -> str:
        """Starts target, draft and orchestrator in order; returns the public address."""
        s = self.settings
        workdir = Path(self._workdir.name)
        self._security = StackSecurity.prepare(s.security, workdir)
        target = self._spawn("target", self.target_arguments())
        self._target_address = self._wait_ready("target", target)
        draft_addresses = list(self._new_replicas(s.draft_replicas if s.draft_dir else 0))
        # The launcher starts new replicas on free loopback ports: AddReplica must accept any of them.
        admin = s.admin_settings(ready_file=workdir / "orchestrator-admin.address", allowed=["127.0.0.1:*"])
        http_ready_file = workdir / "orchestrator-http.url"
        scaler_address = self._start_scaler() if s.draft_dir is not None else None
        orchestrator = s.orchestrator_settings(
            self._target_address, draft_addresses, admin, http_ready_file, scaler_address
        )
        arguments = ["orchestrator", *flags.arguments_of(orchestrator), *self._security.public_arguments()]
        environment = self._security.orchestrator_environment()  # the secrets: never on a command line
        ready_file = self._spawn("orchestrator", [*arguments, *self._tls_arguments()], s.host, s.port, environment)
        self._orchestrator_address = self._wait_ready("orchestrator", ready_file)
        assert admin.ready_file is not None
        self.admin_address = admin.ready_file.read_text().strip()  # written before the public port's file
        if s.http_port is not None:
            self.http_url = http_ready_file.read_text().strip()  # written before the public port's file too
        return self._orchestrator_address

    def _start_scaler(self) -> str:
        """A Scaler service in this process: the orchestrator forwards OrchestratorAdmin.Scale to it."""
        self._scaler = grpc.server(ThreadPoolExecutor(max_workers=2), options=channel_options())
        orchestrator_pb2_grpc.add_ScalerServicer_to_server(LauncherScaler(self), self._scaler)
        assert self._security is not None
        port = self._security.internal().add_port(self._scaler, "127.0.0.1:0")
        self._scaler.start()
        return f"127.0.0.1:{port}"

    def scale(self, count: int) -> None:
        """Starts or stops draft replicas until `count` run; new ones join the orchestrator, removed ones drain."""
        assert self._security is not None
        bound = self.settings.security.max_draft_replicas
        if count > bound:
            raise ValueError(f"draft_replicas: {count} is above --max-draft-replicas {bound}")
        with self._scale_lock:
            running = [child for child in list(self.children) if child.name.startswith("draft-")]
            metadata = self._security.admin_metadata()
            with self._security.admin_client().channel(self.admin_address) as channel:
                admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
                for address in self._new_replicas(count - len(running)):  # each joins once it serves
                    admin.AddReplica(orchestrator_pb2.AddReplicaRequest(address=address), metadata=metadata)
                for child in reversed(running[count:]):
                    request = orchestrator_pb2.RemoveReplicaRequest(replica_id=child.name)
                    admin.RemoveReplica(request, metadata=metadata)
                    self.children.remove(child)  # a planned stop, not a death to restart
                    child.process.send_signal(signal.SIGTERM)
                    child.process.wait(timeout=STOP_TIMEOUT_S)

    def _new_replicas(self, count: int) -> Iterator[str]:
        """Starts `count` new draft replicas at once; yields each one's address, in order, once it serves."""
        added = [f"draft-{next(self._replica_ids)}" for _ in range(count)]
        ready_files = {replica: self._spawn(replica, self.draft_arguments(replica)) for replica in added}
        for replica, ready_file in ready_files.items():
            yield self._wait_ready(replica, ready_file)

    def target_arguments(self) -> list[str]:
        return [*service_arguments("target", self.settings.target_settings()), *self._tls_arguments()]

    def draft_arguments(self, replica_id: str) -> list[str]:
        draft = self.settings.draft_settings(replica_id, self._target_address)
        return [*service_arguments("draft", draft), *self._tls_arguments()]

    def _tls_arguments(self) -> list[str]:
        return [] if self._security is None else self._security.tls_arguments()

    def _spawn(
        self,
        name: str,
        arguments: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        environment: Mapping[str, str] | None = None,
    ) -> Path:
        ready_file = Path(self._workdir.name) / f"{name}.address"
        command = [sys.executable, "-m", "launch.cli", *arguments, "--host", host, "--port", str(port)]
        command += ["--ready-file", str(ready_file), "--keepalive-timeout", str(self.settings.keepalive_timeout_s)]
        environment = without_secrets(os.environ) if environment is None else environment
        self.children.append(Child(name, command, environment, _started(command, environment)))
        return ready_file

    def _wait_ready(self, name: str, ready_file: Path) -> str:
        child = next(child for child in self.children if child.name == name)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            if ready_file.exists():
                address = ready_file.read_text().strip()
                child.keep_port(address)
                return address
            returncode = child.process.poll()
            if returncode is not None:
                raise ChildFailed(name, returncode)
            time.sleep(0.05)
        if self._stopping:
            raise Interrupted(f"stopped while {name} was starting")
        raise TimeoutError(f"{name} did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    def wait(self) -> int:
        """Blocks until a signal arrives, starting children that died again at their addresses (with backoff);
        returns the launcher's exit code. Meanwhile the orchestrator moves a dead replica's requests to the other
        replicas (or target-only), and requests on a dead target wait for it (--target-wait)."""
        while not self._stopping:
            now = time.monotonic()
            for child in list(self.children):
                if child.running:
                    continue
                if child.restart_at is None:
                    print(f"tandem serve: {child.schedule_restart(now)}", file=sys.stderr, flush=True)
                elif now >= child.restart_at:
                    child.process = _started(child.command, child.environment)
                    child.backoff.started, child.restart_at = now, None
            time.sleep(0.2)
        return 0

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def stop(self) -> None:
        if self._scaler is not None:
            self._scaler.stop(grace=None)
        for child in reversed(self.children):
            process = child.process
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=stop_timeout_s(child.name, self.settings.shutdown_timeout_s))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._workdir.cleanup()


def _started(command: list[str], environment: Mapping[str, str]) -> subprocess.Popen[bytes]:
    # Children ignore the terminal's SIGINT (own session); the launcher stops them in order, and should it be
    # killed instead, they get SIGTERM from the kernel (tandem.lifetime).
    return start_child(command, start_new_session=True, env=environment)


class LauncherScaler(orchestrator_pb2_grpc.ScalerServicer):
    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def Scale(
        self, request: orchestrator_pb2.ScaleRequest, context: grpc.ServicerContext
    ) -> orchestrator_pb2.ScaleResponse:
        try:
            self.launcher.scale(request.draft_replicas)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except (ChildFailed, TimeoutError, grpc.RpcError) as error:
            context.abort(grpc.StatusCode.INTERNAL, f"scaling to {request.draft_replicas} replicas failed: {error}")
        return orchestrator_pb2.ScaleResponse()


def ready_line(settings: ServeSettings, address: str, units: str, admin_address: str | None = None) -> str:
    """The one line `tandem serve` prints when Generate is servable (tools wait for it: READY_LINE, ADMIN)."""
    if settings.ngram is not None:
        mode = "speculative, n-gram drafts in the orchestrator"
    elif settings.draft_dir is not None:
        merged = " with n-gram drafts merged in" if settings.scheduler.hybrid is not None else ""
        mode = f"speculative, {settings.draft_replicas} draft replicas{merged}"
    else:
        mode = "target-only"
    admin = f", admin on {admin_address}" if admin_address else ""
    return f"tandem ready: Generate on {address} ({mode}, {units}{admin})"


def serve(settings: ServeSettings) -> int:
    launcher = Launcher(settings)
    signal.signal(signal.SIGINT, launcher.request_stop)
    signal.signal(signal.SIGTERM, launcher.request_stop)
    try:
        address = launcher.start()
        line = ready_line(settings, address, f"{len(launcher.children)} processes", launcher.admin_address)
        if launcher.http_url:
            print(http_line(launcher.http_url), flush=True)  # before the ready line, which tools wait for
        print(line, flush=True)
        return launcher.wait()
    except ChildFailed as error:
        print(f"tandem serve: {error}", file=sys.stderr, flush=True)
        return error.returncode or 1
    except Interrupted:
        return 0
    finally:
        launcher.stop()


def http_line(url: str) -> str:
    return f"tandem HTTP API: {url}/v1 (OpenAI-compatible), metrics on {url}/metrics"


READY_LINE = re.compile(r"tandem ready: Generate on (\S+)")
HTTP_LINE = re.compile(r"tandem HTTP API: (\S+)/v1 ")
ADMIN = re.compile(r"admin on ([^\s,)]+)")


class ServeProcess:
    """`tandem serve ...` started as a child process, for tools and tests that need a running stack.

    Collects the merged output in `log` and exposes the public address once the ready line appears. The stack ends
    with the process that started it, however that process ends (tandem.lifetime): a benchmark killed by the OOM
    killer or by SIGKILL leaves no stack behind.
    """

    def __init__(
        self,
        arguments: Sequence[str],
        ready_timeout_s: float = STARTUP_TIMEOUT_S,
        module: str = "launch.cli",  # the CLI module (another tree's, with `env`, for an A/B of two trees)
        env: Mapping[str, str] | None = None,  # the whole environment; None: this process's
    ) -> None:
        command = [sys.executable, "-m", module, "serve", *arguments]
        self.process = start_child(command, pipe_output=True, env=env)
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.address = self._wait_ready(ready_timeout_s)
        ready = next(line for line in self.log if READY_LINE.search(line))
        self.admin_address = match.group(1) if (match := ADMIN.search(ready)) else None
        # The HTTP API's URL ("" without one), printed before the ready line.
        self.http_url = next((found.group(1) for line in self.log if (found := HTTP_LINE.search(line))), "")

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.decode(errors="replace"))

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            for line in list(self.log):
                if match := READY_LINE.search(line):
                    return match.group(1)
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError("tandem serve did not become ready:\n" + "".join(self.log))
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM, as a process manager would; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=STOP_TIMEOUT_S * 4)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()
