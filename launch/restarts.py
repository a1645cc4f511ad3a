"""Restarts: a service that dies is started again at its own address, with backoff, as Kubernetes restarts a pod's
container; the process launcher's children (Child) and the Ray launcher's actors (launch.ray_cluster) alike.

A child that had run RESET_AFTER_S or more waits FIRST_BACKOFF_S before its restart; one that dies again sooner waits
twice as long as the time before, up to MAX_BACKOFF_S. Its peers find it where it was: a restarted target is told
apart from the one before by the instance it announces (the orchestrator's requests start over on it), a restarted
replica rejoins when the orchestrator probes it, a restarted orchestrator serves new requests on the same port.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
RESET_AFTER_S = 60.0


@dataclass
class Backoff:
    """When a service that died starts again: FIRST_BACKOFF_S after a run of RESET_AFTER_S or more, else twice the
    wait before, up to MAX_BACKOFF_S."""

    started: float = field(default_factory=time.monotonic)
    backoff_s: float = 0.0  # the last wait before a restart (0: none since it last ran RESET_AFTER_S)

    def next_wait(self, now: float) -> float:
        ran_s = now - self.started
        self.backoff_s = FIRST_BACKOFF_S if ran_s >= RESET_AFTER_S or not self.backoff_s else self.backoff_s * 2
        self.backoff_s = min(self.backoff_s, MAX_BACKOFF_S)
        return self.backoff_s


@dataclass
class Child:
    name: str
    command: list[str]  # ends with --port P: 0 until the first start told which port it got, then that one
    environment: Mapping[str, str]
    process: subprocess.Popen[bytes]
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None  # when a dead child starts again; None: it runs, or its death is not seen yet

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def keep_port(self, address: str) -> None:
        """Restarts bind the port the first start got (`address` is host:port, as its ready file says)."""
        self.command[self.command.index("--port") + 1] = address.rpartition(":")[2]

    def schedule_restart(self, now: float) -> str:
        """Notes the death and when to start again; returns the line that says so."""
        ran_s = now - self.backoff.started
        wait_s = self.backoff.next_wait(now)
        self.restart_at = now + wait_s
        return (
            f"{self.name} exited with code {self.process.returncode} after {ran_s:.1f} s; "
            f"starting it again at its address in {wait_s:.0f} s"
        )
