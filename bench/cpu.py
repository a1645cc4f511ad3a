"""CPU seconds a benchmark run costs, by process role, so that a setup's cores can be accounted for.

On a machine with few cores the split stack's three processes share them: a run's wall time says how long it took,
its CPU time says how much of the machine it kept busy and which process did. A meter samples the user + system
seconds of a set of processes before and after a run; the report divides the difference by the run's tokens.

Roles of the split stack are read from each process's command line (`launch.cli target|draft|orchestrator`, the
children of `tandem serve`; the launcher itself is `serve`); the colocated engine runs in the benchmark's own
process, which also runs the client, so its one role is `process`. A process that exits during a run (a replica
killed by a test) takes its seconds with it.
"""

from __future__ import annotations

import psutil

SPLIT_ROLES = ("target", "draft", "orchestrator")
OWN_PROCESS = "process"


class CpuMeter:
    """Samples CPU seconds by role: `tree` of a root process (its descendants by role), or the root alone."""

    def __init__(self, pid: int, tree: bool) -> None:
        self.root = psutil.Process(pid)
        self.tree = tree

    def sample(self) -> dict[str, float]:
        if not self.tree:
            return {OWN_PROCESS: _seconds(self.root)}
        totals: dict[str, float] = {}
        for process in [self.root, *self.root.children(recursive=True)]:
            try:
                role = role_of(process.cmdline())
                seconds = _seconds(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            totals[role] = totals.get(role, 0.0) + seconds
        return totals


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds by role (CPU, or a counter's parts) between two samples (roles seen in the second; one new since the
    first counts from zero)."""
    return {role: max(0.0, seconds - before.get(role, 0.0)) for role, seconds in after.items()}


def _seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def role_of(command: list[str]) -> str:
    """`python -m launch.cli draft --model ...` -> "draft"; anything else under the stack -> "other"."""
    if "launch.cli" in command:
        index = command.index("launch.cli")
        if index + 1 < len(command):
            return command[index + 1]
    return "other"
