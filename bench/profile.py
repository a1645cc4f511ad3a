"""`tandem bench-profile`: where one request's time goes in each process of the split stack, by phase.

The stack (`tandem serve`, the demo pair unless --target/--draft say otherwise, at a fixed k) decodes held-out
prompts one at a time, target-only and then speculatively, each twice. In the plain run the kernel's scheduler
statistics of the target, the draft replica and the orchestrator (/proc/PID/task/*/schedstat, all threads) give each
process's time on a core and its time waiting for one, per generated token. In the sampled run py-spy samples the three
(`py-spy record --nonblocking`: they are never stopped); a sample is the Python stack of a thread that was running,
and its phase is that of the innermost frame a rule of PHASES names (a torch call counts as the model code that made
it), "other" where none does. A process's time on a core is split by its phases' shares of its samples: the
samplers take cores themselves (three of them at 250 Hz more than doubled the target's wait for a core on 2 cores),
so the sampled run gives shares, never times. py-spy needs ptrace rights over the services (root, or the same user
with ptrace allowed).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.cpu import SPLIT_ROLES, role_of
from bench.harness import GrpcGenerate, run_prompts
from bench.machine import machine
from bench.prompts import held_out_prompts
from bench.settings import ProfileSettings
from launch.processes import ServeProcess

# (phase, path fragments): the first phase whose fragment occurs in a frame's file, tried from the innermost frame
# outwards. Attention comes before the model: its files are under tandem/layers too.
PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention and KV paging", ("tandem/layers/attention", "tandem/layers/kv_cache", "tandem/layers/page_table")),
    ("model forward", ("tandem/models/", "tandem/layers/", "torch/nn/")),
    ("sampling and verification", ("tandem/sampling/", "target_server/commit", "draft_server/shaping")),
    ("serialization", ("google/protobuf", "_pb2", "tandem/wire/", "tandem/transport")),
    ("gRPC", ("grpc/", "grpc_util")),
    ("scheduling", ("orchestrator/", "target_server/", "draft_server/", "asyncio/", "tandem/model_thread")),
)
OTHER = "other"
WAITING = "waiting for a core (run queue)"
# py-spy takes a moment to attach (over a second under load), and a SIGINT before it samples kills it with nothing
# written: the run starts once each one says it samples, within this long.
ATTACH_TIMEOUT_S = 60.0
SAMPLING = b"Sampling process"  # what py-spy record prints once it samples


@dataclass
class Profile:
    """One mode's two runs, by process role: the plain run's times, the sampled run's phases."""

    mode: str
    tokens: int = 0  # generated in the plain run (the sampled run generates the same)
    tokens_per_second: tuple[float, float] = (0.0, 0.0)  # plain, sampled
    on_core: dict[str, float] = field(default_factory=dict)  # role -> seconds on a core (schedstat)
    waiting: dict[str, float] = field(default_factory=dict)  # role -> seconds runnable but not running
    phases: dict[str, Counter[str]] = field(default_factory=dict)  # role -> phase -> samples

    def ms_per_token(self, role: str, phase: str | None = None) -> float:
        """A process's milliseconds on a core per token, all of them or a phase's share."""
        total = 1000.0 * self.on_core.get(role, 0.0) / max(1, self.tokens)
        if phase is None:
            return total
        samples = self.phases.get(role, Counter())
        return total * samples[phase] / max(1, sum(samples.values()))


def phase_of(stack: str) -> str:
    """The phase of a py-spy raw stack ("outer (file:line);...;inner (file:line)")."""
    for frame in reversed(stack.split(";")):
        for phase, fragments in PHASES:
            if any(fragment in frame for fragment in fragments):
                return phase
    return OTHER


def read_raw(text: str) -> Counter[str]:
    """Samples by phase from py-spy's raw output: one line per stack, its sample count last."""
    phases: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            phases[phase_of(stack)] += int(count)
    return phases


def schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a core, seconds waiting for one) of every thread of a process so far."""
    on_core = waiting = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            running, queued, _ = (task / "schedstat").read_text().split()
        except (FileNotFoundError, ValueError):
            continue  # a thread that ended meanwhile
        on_core, waiting = on_core + int(running), waiting + int(queued)
    return on_core / 1e9, waiting / 1e9


def service_pids(stack: ServeProcess) -> dict[str, int]:
    """The stack's service processes by role (bench.cpu's roles)."""
    pids = {}
    for child in psutil.Process(stack.process.pid).children(recursive=True):
        role = role_of(child.cmdline())
        if role in SPLIT_ROLES:
            pids[role] = child.pid
    missing = set(SPLIT_ROLES) - set(pids)
    if missing:
        raise RuntimeError(f"the stack has no {', '.join(sorted(missing))} process to profile")
    return pids


def run_profile(settings: ProfileSettings) -> list[Profile]:
    """Target-only, then speculative, each over the same prompts at one request at a time."""
    # A fixed k: the speculative runs profile speculation whatever adaptive k would choose for the pair (the demo
    # pair's one request drafts 5 either way; a draft that is rarely right would otherwise soon draft nothing).
    arguments = ["--target", str(settings.target_dir), "--draft", str(settings.draft_dir), "--no-adaptive-k"]
    stack = ServeProcess([*arguments, "--port", "0", "--admin-port", "0"])
    try:
        return asyncio.run(_profiled_runs(stack.address, settings, service_pids(stack)))
    finally:
        stack.stop()


async def _profiled_runs(address: str, settings: ProfileSettings, pids: dict[str, int]) -> list[Profile]:
    prompts, tokens = held_out_prompts(settings.num_prompts), settings.max_new_tokens
    generate = GrpcGenerate(address)
    try:
        for speculative in (False, True):  # warm-up, not profiled
            await run_prompts(generate, prompts[:2], 1, tokens, speculative, "warm-up")
        profiles = []
        for mode in ("target-only", "speculative"):
            profile, speculative = Profile(mode), mode == "speculative"
            before = {role: schedstat(pid) for role, pid in pids.items()}
            plain = await run_prompts(generate, prompts, 1, tokens, speculative, "split")
            for role, pid in pids.items():
                on_core, waiting = schedstat(pid)
                profile.on_core[role], profile.waiting[role] = on_core - before[role][0], waiting - before[role][1]
            with _sampled(pids, profile, settings):
                sampled = await run_prompts(generate, prompts, 1, tokens, speculative, "split, sampled")
            profile.tokens = plain.completion_tokens
            profile.tokens_per_second = (plain.tokens_per_second, sampled.tokens_per_second)
            profiles.append(profile)
        return profiles
    finally:
        await generate.close()


@contextmanager
def _sampled(pids: dict[str, int], profile: Profile, settings: ProfileSettings) -> Iterator[None]:
    """py-spy on each process over the block; its samples by phase into `profile`."""
    settings.out.mkdir(parents=True, exist_ok=True)
    spies = {}
    for role, pid in pids.items():
        raw, log = settings.out / f"{profile.mode}-{role}.txt", settings.out / f"{profile.mode}-{role}.log"
        command = ["py-spy", "record", "--pid", str(pid), "--rate", str(settings.rate), "--nonblocking"]
        command += ["--format", "raw", "--output", str(raw)]
        with log.open("wb") as lines:  # py-spy's own lines
            spies[role] = (subprocess.Popen(command, stdout=lines, stderr=subprocess.STDOUT), raw)
        _wait_sampling(role, spies[role][0], log)
    yield
    for spy, _ in spies.values():
        spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
    for role, (spy, raw) in spies.items():
        if spy.wait(timeout=60) != 0 or not raw.exists():
            raise RuntimeError(f"py-spy on the {role} process failed (exit {spy.returncode})")
        profile.phases[role] = read_raw(raw.read_text())


def _wait_sampling(role: str, spy: subprocess.Popen[bytes], log: Path) -> None:
    """Returns once py-spy says it samples; raises if it exits first or does not within ATTACH_TIMEOUT_S."""
    deadline = time.monotonic() + ATTACH_TIMEOUT_S
    while SAMPLING not in log.read_bytes():
        if spy.poll() is not None:
            raise RuntimeError(
                f"py-spy on the {role} process exited before it sampled ({spy.returncode}): no ptrace rights?"
            )
        if time.monotonic() > deadline:
            spy.kill()
            raise RuntimeError(f"py-spy on the {role} process did not start sampling within {ATTACH_TIMEOUT_S:g} s")
        time.sleep(0.05)


def report(profiles: list[Profile], command: str) -> str:
    """A markdown table per mode: milliseconds on a core per generated token, by phase and process."""
    lines = [f"`{command}`", ""]
    for profile in profiles:
        roles = [role for role in SPLIT_ROLES if role in profile.on_core]
        plain, sampled = profile.tokens_per_second
        lines += [f"### {profile.mode}: {profile.tokens} tokens, {plain:.1f} tok/s ({sampled:.1f} sampled)", ""]
        lines += ["| ms per token | " + " | ".join(roles) + " |", "|---" * (len(roles) + 1) + "|"]
        for phase in [*(phase for phase, _ in PHASES), OTHER]:
            cells = [f"{profile.ms_per_token(role, phase):.2f}" for role in roles]
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        lines.append("| on a core, in all | " + " | ".join(f"{profile.ms_per_token(r):.2f}" for r in roles) + " |")
        waits = [f"{1000 * profile.waiting[role] / max(1, profile.tokens):.2f}" for role in roles]
        lines += [f"| {WAITING} | " + " | ".join(waits) + " |", ""]
    return "\n".join(lines)


def main(settings: ProfileSettings) -> Path:
    profiles = run_profile(settings)
    command = " ".join(["tandem bench-profile", *sys.argv[2:]])
    text = report(profiles, f"{command}` on {machine()}, `{settings.target_dir.name}` + `{settings.draft_dir.name}")
    path = settings.out / "latest.md"
    path.write_text(text)
    return path
