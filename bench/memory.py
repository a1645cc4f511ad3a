"""Resident memory of a process tree (a `tandem serve` and its services), sampled on a thread.

Each process is named once, when first seen: the root is "serve", a Tandem service is its command ("target",
"orchestrator") or, for a draft, its replica id ("draft-0"); anything else (a tensor-parallel rank, a helper) is
its executable name and pid. The peak of the samples can miss a spike shorter than the interval, so the kernel's
own high-water mark (VmHWM in /proc/PID/status, Linux only) is read at the end as well; it counts from the
process's start, model loading included.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import psutil

MIB = 1 << 20
ROLES = ("serve", "target", "draft", "orchestrator")  # the order of a report's rows


@dataclass(frozen=True)
class ProcessMemory:
    name: str
    pid: int
    samples: int
    rss_start_bytes: int  # the first sample
    rss_peak_bytes: int  # the largest sample
    rss_end_bytes: int  # the last sample
    vm_hwm_bytes: int | None  # the kernel's peak resident size since the process started; None: not available


def process_name(process: psutil.Process, root_pid: int) -> str:
    """The name a process of the stack goes by in reports (see the module docstring)."""
    if process.pid == root_pid:
        return "serve"
    arguments = process.cmdline()
    if "launch.cli" in arguments:
        command = arguments[arguments.index("launch.cli") + 1 :]
        if command and command[0] == "draft" and "--replica-id" in command:
            return command[command.index("--replica-id") + 1]
        if command:
            return command[0]
    return f"{process.name()}-{process.pid}"


def report_order(name: str) -> tuple[int, str]:
    """Sort key of process names: the launcher, the target, the drafts, the orchestrator, then anything else."""
    role = "draft" if name.startswith("draft-") else name
    return (ROLES.index(role) if role in ROLES else len(ROLES)), name


def command_option(process: psutil.Process, flag: str) -> str | None:
    """The value a process was started with for `flag` (the first one), or None."""
    arguments = process.cmdline()
    if flag in arguments[:-1]:
        return arguments[arguments.index(flag) + 1]
    return None


def vm_hwm_bytes(pid: int) -> int | None:
    """VmHWM of a running process, from /proc (None where there is no /proc or no such line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            if unit == "kB":
                return int(value) * 1024
    return None


@dataclass
class _Track:
    name: str
    process: psutil.Process
    samples: int = 0
    start: int = 0
    peak: int = 0
    end: int = 0


class MemorySampler:
    """Samples the resident set size of `root_pid` and all its descendants every `interval_s` seconds."""

    def __init__(self, root_pid: int, interval_s: float) -> None:
        self.root = psutil.Process(root_pid)
        self.interval_s = interval_s
        self._tracks: dict[int, _Track] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def processes(self) -> dict[str, psutil.Process]:
        """Every process seen so far, by name."""
        with self._lock:
            return {track.name: track.process for track in self._tracks.values()}

    def sample(self) -> None:
        """One sample of every live process of the tree; processes that end between the steps are skipped."""
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                track = self._tracks.get(process.pid)
                if track is None:
                    track = _Track(process_name(process, self.root.pid), process)
                rss = process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            with self._lock:
                track = self._tracks.setdefault(process.pid, track)
                track.start = rss if track.samples == 0 else track.start
                track.peak = max(track.peak, rss)
                track.end = rss
                track.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> list[ProcessMemory]:
        """Stops sampling (the processes must still run, for their VmHWM); one record per process, by name."""
        self._stop.set()
        self._thread.join()
        self.sample()
        with self._lock:
            tracks = sorted(self._tracks.values(), key=lambda track: report_order(track.name))
        return [
            ProcessMemory(
                track.name,
                track.process.pid,
                track.samples,
                track.start,
                track.peak,
                track.end,
                vm_hwm_bytes(track.process.pid),
            )
            for track in tracks
        ]
