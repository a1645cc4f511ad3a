"""`tandem serve --launcher process`: the three services as child processes on loopback.

Each child binds a free port and writes its address to a ready file; the launcher passes addresses
on, prints one `ready` line when Generate is servable, and stops the children (orchestrator, drafts,
target) on SIGINT or SIGTERM. A child that exits during start-up stops everything with its exit code. Children
end with the launcher however it ends: killed, it leaves them SIGTERM from the kernel (tandem.lifetime).
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
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import grpc

from draft_server.settings import DraftSettings, MTPFeedback, MTPMode
from launch.stack_security import ServeSecurity, StackSecurity, without_secrets
from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem.grpc_util import channel_options
from tandem.lifetime import start_child
from tandem.settings import KVCacheSettings, TreeShape
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from target_server.settings import TargetSettings

STARTUP_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ServeSettings:
    target_dir: Path
    draft_dir: Path | None  # None: no draft process (target-only, or ngram)
    ngram: NgramSettings | None = None  # --draft ngram: the orchestrator drafts by prompt lookup (draft_dir is None)
    draft_replicas: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    # The orchestrator's: draft steps, tree shape (resolved; topk 1: chains), batching limits, timeouts, --hybrid-ngram.
    # Drafts take its num_steps and tree too.
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    aux_layer_convention: str = "auto"
    dtype: str = "float32"  # resolved, as device (tandem.devices)
    device: str = "cpu"  # target rank 0's and every draft replica's: "cpu" or "cuda:N"
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)  # the target's pool, and each replica's
    launcher: str = "process"  # "ray": launch.ray_cluster
    ray_address: str | None = None  # the Ray cluster to join; None: start a local one
    tp: int = TargetSettings.tp  # the target's tensor-parallel ranks
    target_threads: int = TargetSettings.threads  # intra-op threads of each target rank (0: its share of the cores)
    draft_threads: int = DraftSettings.threads  # intra-op threads of each draft replica (0: the cores)
    mtp_feedback: MTPFeedback = DraftSettings.mtp_feedback  # see draft_server.settings
    mtp_mode: MTPMode = DraftSettings.mtp_mode
    security: ServeSecurity = field(default_factory=ServeSecurity)  # API key, admin port, TLS
    http_port: int | None = 0  # the orchestrator's OpenAI-compatible HTTP API and /metrics; 0: a free port; None: off
    chat_template: Path | None = None  # for /v1/chat/completions when the tokenizer has none
    served_model_name: str | None = None  # None: the target directory's name


def ngram_arguments(ngram: NgramSettings | None) -> list[str]:
    """The flags that give `tandem serve` or `tandem orchestrator` these n-gram settings (none: no n-gram drafting)."""
    if ngram is None:
        return []
    return ["--draft", "ngram", *ngram_lengths(ngram)]


def hybrid_arguments(hybrid: HybridSettings | None) -> list[str]:
    """The flags that give `tandem serve` or `tandem orchestrator` these hybrid settings (none: no merging)."""
    return [] if hybrid is None else ["--hybrid-ngram", *ngram_lengths(hybrid.ngram)]


def ngram_lengths(ngram: NgramSettings) -> list[str]:
    return ["--ngram-max", str(ngram.max_n), "--ngram-min", str(ngram.min_n)]


class ChildFailed(RuntimeError):
    def __init__(self, name: str, returncode: int) -> None:
        super().__init__(f"{name} exited with code {returncode} during start-up (its log is above)")
        self.returncode = returncode


class Interrupted(RuntimeError):
    """A signal arrived before every service was ready."""


class Launcher:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
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
        self._security = StackSecurity.prepare(s.security, Path(self._workdir.name))
        target = self._spawn("target", self.target_arguments())
        target_address = self._wait_ready("target", target)
        self._target_address = target_address
        draft_addresses = []
        replicas = [f"draft-{next(self._replica_ids)}" for _ in range(s.draft_replicas)] if s.draft_dir else []
        ready_files = {
            replica: self._spawn(replica, self.draft_arguments(replica, target_address)) for replica in replicas
        }
        for replica, ready_file in ready_files.items():
            draft_addresses.append(self._wait_ready(replica, ready_file))
        arguments = ["orchestrator", "--target-address", target_address, "--tokenizer", str(s.target_dir)]
        for address in draft_addresses:
            arguments += ["--draft-address", address]
        arguments += self.scheduler_arguments()
        if s.draft_dir is not None:
            arguments += ["--scaler-address", self._start_scaler()]
        admin_ready_file = Path(self._workdir.name) / "orchestrator-admin.address"
        arguments += [*self._security.orchestrator_arguments(), "--admin-ready-file", str(admin_ready_file)]
        arguments += self._tls_arguments()
        http_ready_file = Path(self._workdir.name) / "orchestrator-http.url"
        arguments += self.http_arguments(http_ready_file)
        environment = self._security.orchestrator_environment()
        orchestrator = self._spawn("orchestrator", arguments, host=s.host, port=s.port, environment=environment)
        self._orchestrator_address = self._wait_ready("orchestrator", orchestrator)
        self.admin_address = admin_ready_file.read_text().strip()  # written before the public port's file
        if s.http_port is not None:
            self.http_url = http_ready_file.read_text().strip()  # written before the public port's file too
        return self._orchestrator_address

    def http_arguments(self, ready_file: Path) -> list[str]:
        s = self.settings
        arguments = []
        if s.http_port is not None:
            arguments += ["--http-port", str(s.http_port), "--http-ready-file", str(ready_file)]
        if s.chat_template is not None:
            arguments += ["--chat-template", str(s.chat_template)]
        if s.served_model_name is not None:
            arguments += ["--served-model-name", s.served_model_name]
        return arguments

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
            running = [(name, p) for name, p in list(self.children) if name.startswith("draft-") and p.poll() is None]
            metadata = self._security.admin_metadata()
            with self._security.admin_client().channel(self.admin_address) as channel:
                admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
                for _ in range(count - len(running)):
                    replica = f"draft-{next(self._replica_ids)}"
                    ready_file = self._spawn(replica, self.draft_arguments(replica, self._target_address))
                    address = self._wait_ready(replica, ready_file)
                    admin.AddReplica(orchestrator_pb2.AddReplicaRequest(address=address), metadata=metadata)
                for name, process in reversed(running[count:]):
                    admin.RemoveReplica(orchestrator_pb2.RemoveReplicaRequest(replica_id=name), metadata=metadata)
                    self.children.remove((name, process))  # a planned stop, not a death to report
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=STOP_TIMEOUT_S)

    def scheduler_arguments(self) -> list[str]:
        s = self.settings.scheduler
        return [
            "--speculative-num-steps", str(s.num_steps),
            *tree_arguments(s.tree),
            "--max-num-seqs", str(s.max_num_seqs),
            "--max-num-batched-tokens", str(s.max_num_batched_tokens),
            "--max-waiting", str(s.max_waiting),
            "--num-scheduler-steps", str(s.num_scheduler_steps),
            "--adaptive-k" if s.adaptive_k else "--no-adaptive-k",
            "--draft-ahead", str(s.draft_ahead),
            "--push-drafts" if s.push_drafts else "--no-push-drafts",
            "--target-timeout", str(s.target_timeout_s),
            "--draft-timeout", str(s.draft_timeout_s),
            *ngram_arguments(self.settings.ngram),
            *hybrid_arguments(s.hybrid),
        ]  # fmt: skip

    def cache_arguments(self) -> list[str]:
        cache = self.settings.cache
        pool = (
            ["--kv-cache-memory", str(cache.memory_bytes)]
            if cache.memory_bytes
            else ["--kv-blocks", str(cache.num_blocks)]
        )
        backend = ["--attention-backend", cache.attention_backend] if cache.attention_backend else []
        return [
            *pool,
            "--block-size", str(cache.block_size),
            "--orphan-timeout", str(cache.orphan_timeout_s),
            *backend,
            "--cuda-graphs" if cache.cuda_graphs else "--no-cuda-graphs",
        ]  # fmt: skip

    def target_arguments(self) -> list[str]:
        s = self.settings
        return [
            "target",
            "--model", str(s.target_dir),
            "--dtype", s.dtype,
            "--device", s.device,
            "--tp", str(s.tp),
            "--threads", str(s.target_threads),
            *self.cache_arguments(),
            *self._tls_arguments(),
        ]  # fmt: skip

    def draft_arguments(self, replica_id: str, target_address: str) -> list[str]:
        s = self.settings
        assert s.draft_dir is not None
        return [
            "draft",
            "--model", str(s.draft_dir),
            "--target-address", target_address,
            "--replica-id", replica_id,
            "--speculative-num-steps", str(s.scheduler.num_steps),
            *tree_arguments(s.scheduler.tree),
            "--aux-layer-convention", s.aux_layer_convention,
            "--dtype", s.dtype,
            "--device", s.device,
            "--threads", str(s.draft_threads),
            "--mtp-feedback", s.mtp_feedback,
            "--mtp-mode", s.mtp_mode,
            *self.cache_arguments(),
            *self._tls_arguments(),
        ]  # fmt: skip

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
        command += ["--ready-file", str(ready_file)]
        # Children ignore the terminal's SIGINT (own session); the launcher stops them in order, and should it be
        # killed instead, they get SIGTERM from the kernel (tandem.lifetime).
        environment = without_secrets(os.environ) if environment is None else environment
        process = start_child(command, start_new_session=True, env=environment)
        self.children.append((name, process))
        return ready_file

    def _wait_ready(self, name: str, ready_file: Path) -> str:
        process = dict(self.children)[name]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping:
            if ready_file.exists():
                return ready_file.read_text().strip()
            returncode = process.poll()
            if returncode is not None:
                raise ChildFailed(name, returncode)
            time.sleep(0.05)
        if self._stopping:
            raise Interrupted(f"stopped while {name} was starting")
        raise TimeoutError(f"{name} did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    def wait(self) -> int:
        """Blocks until a signal arrives or the target or orchestrator dies; returns the launcher's exit code.

        A draft replica that dies is reported and left dead: the orchestrator moves its requests to the
        other replicas (or target-only) and serving goes on.
        """
        reported: set[str] = set()
        while not self._stopping:
            for name, process in list(self.children):
                if process.poll() is None or name in reported:
                    continue
                reported.add(name)
                if name.startswith("draft"):
                    message = f"draft replica {name} exited with code {process.returncode}; serving goes on without it"
                    print(f"tandem serve: {message}", file=sys.stderr, flush=True)
                    continue
                print(f"tandem serve: {name} exited with code {process.returncode}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        return 0

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stopping = True

    def stop(self) -> None:
        if self._scaler is not None:
            self._scaler.stop(grace=None)
        for _, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._workdir.cleanup()


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

    def __init__(self, arguments: Sequence[str], ready_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        command = [sys.executable, "-m", "launch.cli", "serve", *arguments]
        self.process = start_child(command, pipe_output=True)
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


def tree_arguments(tree: TreeShape) -> list[str]:
    """The flags that give a service the same tree shape (resolved: num_draft_tokens is set)."""
    return [
        "--speculative-eagle-topk", str(tree.topk),
        "--speculative-num-draft-tokens", str(tree.num_draft_tokens),
    ]  # fmt: skip
