"""The Ray actors of `tandem serve --launcher ray` (launch.ray_cluster): a service, or a target rank other than 0.

Each runs on a thread of its actor what its `tandem` subcommand runs in a process, and reports how it ended as the
process's exit code would (ServiceExit). They import torch and the services only in the actor; the orchestrator's
actor, as its process (launch.service_commands.hide_torch), none.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import ray

from draft_server.settings import DraftSettings
from launch.actor_security import ActorSecurity, ServiceSettings
from launch.service_commands import hide_torch
from tandem.errors import StartupError
from tandem.grpc_util import set_keepalive_timeout
from tandem.serving import ListenSettings, configure_logging
from target_server.settings import TargetSettings

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceExit:
    """How a service ended: `code` is what its own process would have exited with."""

    code: int
    reason: str


async def run_service(settings: ServiceSettings, listen: ListenSettings) -> None:
    """The service coroutine its `tandem` subcommand runs (imported here: they load torch)."""
    if isinstance(settings, TargetSettings):
        from target_server.main import serve_target

        await serve_target(settings, listen)
    elif isinstance(settings, DraftSettings):
        from draft_server.main import serve_draft

        await serve_draft(settings, listen)
    else:
        hide_torch()  # an actor's process runs this service alone
        from orchestrator.main import serve_orchestrator

        await serve_orchestrator(settings, listen)


class ServiceActor:
    """One service on an event loop in a thread of this actor; the methods only watch and stop it.

    `host` None binds the address of the actor's node (a joined cluster spans machines). The work directory
    (0700, removed when the service ends) holds the ready file and the certificates `security` writes.
    """

    def __init__(
        self,
        name: str,
        settings: ServiceSettings,
        host: str | None,
        port: int,
        security: ActorSecurity,
        keepalive_timeout_s: float,
    ) -> None:
        configure_logging(name)
        set_keepalive_timeout(keepalive_timeout_s)
        self.name = name
        self._workdir = tempfile.TemporaryDirectory(prefix=f"tandem-{name}-")
        self._ready_file = Path(self._workdir.name) / "address"
        listen = ListenSettings(host=host or ray.util.get_node_ip_address(), port=port, ready_file=self._ready_file)
        settings, listen = security.secure(settings, listen, Path(self._workdir.name))
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._ended = threading.Event()
        self._exit: ServiceExit | None = None  # set under _lock while the loop still runs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        threading.Thread(target=self._run, args=(settings, listen), name=name, daemon=True).start()

    def __repr__(self) -> str:
        return self.name  # Ray prefixes the actor's forwarded log lines with this

    def _run(self, settings: ServiceSettings, listen: ListenSettings) -> None:
        # A nested coroutine, not a method: one `async def` method would make Ray run every method of
        # this actor on a single event loop, where the blocking wait_until_stopped() would starve the rest.
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._started.set()
            try:
                await run_service(settings, listen)
                outcome = ServiceExit(0, "stopped")
            except asyncio.CancelledError:
                outcome = ServiceExit(0, "stopped")
            except StartupError as error:
                outcome = ServiceExit(2, f"cannot start: {error}")  # 2: what `tandem <service>` exits with
            except SystemExit as error:  # run_server: an essential background task ended
                outcome = ServiceExit(error.code if isinstance(error.code, int) else 1, "stopped on its own")
            except Exception as error:
                LOG.exception("%s failed", self.name)
                outcome = ServiceExit(1, f"failed: {error!r}")
            with self._lock:
                self._exit = outcome

        try:
            asyncio.run(serve())
        finally:
            self._workdir.cleanup()
            self._ended.set()

    def address(self) -> str | None:
        """Blocks until the service serves and returns its host:port; None if it ended first."""
        while not self._ready_file.exists():
            if self._ended.wait(timeout=0.05):
                return None
        return self._ready_file.read_text().strip()

    def process(self) -> str:
        """Where this actor runs, for the launcher's log."""
        return f"pid {os.getpid()} on node {ray.util.get_node_ip_address()}"

    def wait_until_stopped(self) -> ServiceExit:
        """Blocks for as long as the service runs; the launcher watches this call to notice an end."""
        self._ended.wait()
        assert self._exit is not None
        return self._exit

    def stop(self) -> ServiceExit:
        """Stops the service as SIGTERM stops its process (cancellation, then the graceful shutdown)."""
        self._started.wait()
        with self._lock:
            if self._exit is None:
                assert self._loop is not None and self._task is not None
                self._loop.call_soon_threadsafe(self._task.cancel)
        return self.wait_until_stopped()


class RankActor:
    """A target rank other than 0 (target_server.rank) on a thread of this actor; rank 0's STOP ends it."""

    def __init__(self, name: str, settings: TargetSettings, rank: int) -> None:
        configure_logging(name)
        self.name = name
        self._ended = threading.Event()
        self._exit: ServiceExit | None = None
        threading.Thread(target=self._run, args=(settings, rank), name=name, daemon=True).start()

    def __repr__(self) -> str:
        return self.name

    def _run(self, settings: TargetSettings, rank: int) -> None:
        from target_server.rank import run_rank  # loads torch: only in the actor

        try:
            run_rank(settings, rank)
            self._exit = ServiceExit(0, "stopped")
        except StartupError as error:
            self._exit = ServiceExit(2, f"cannot start: {error}")
        except Exception as error:  # the group broke: rank 0 went away without saying stop
            LOG.exception("%s failed", self.name)
            self._exit = ServiceExit(1, f"failed: {error!r}")
        finally:
            self._ended.set()

    def wait_until_stopped(self) -> ServiceExit:
        self._ended.wait()
        assert self._exit is not None
        return self._exit

    def stop(self) -> ServiceExit:
        """Rank 0 stops this rank (the launcher stops rank 0 first); this only waits for that."""
        return self.wait_until_stopped()


def rendezvous_on_this_node(host: str | None) -> str:
    """A free "host:port" on the node this runs on (`host` None: the node's IP), for the target's ranks to meet."""
    from tandem.parallel.group import free_rendezvous  # loads torch: only on the node

    return free_rendezvous(host or ray.util.get_node_ip_address())
