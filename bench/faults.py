"""`tandem bench-faults`: what each fault between Tandem's services costs, as a table.

One stack (bench.fault_stack: target, one draft replica, two orchestrators, a fault proxy on each link) serves 8
greedy and 2 seeded sampled streams (bench.fault_streams) through each scenario in turn: latency, a reset of every
connection, refused connections or a blackhole on each link; a draft replica paused or killed and started again; the
target paused or killed and started again; the orchestrator sent SIGTERM (its streams drain), SIGTERM with a short
--shutdown-timeout, or killed and started again, or killed with its clients resuming on the second orchestrator
(bench.orchestrator_faults). For each it records the streams that completed, failed and hung, those whose tokens equal
a run without the fault and without speculation, those with tokens repeated, missing or changed, how often clients
resumed, the longest stall between two chunks of a stream from the fault on, the time until a service logged a
warning or error about it, what the target and replica still hold once settled, services that exited by themselves,
whether the replica drafts again, and what a killed or signalled service did (exit code, back after, new requests
refused after).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.fault_stack import CACHE_FLAGS, LINKS, ORCHESTRATOR_FLAGS, SHORT_SHUTDOWN_S, FaultStack, Signalled
from bench.fault_streams import NEW_TOKENS, STREAMS, completion, held_after, streams_through, target_only
from bench.orchestrator_faults import drain, takeover
from launch.model_dirs import shown

Fault = Callable[[], Signalled | None]  # what it saw of the service it signalled, if it did
# How long a link refuses connections: past the first reconnect attempts (backoff 0.1 s up to 1 s,
# tandem.grpc_util.channel_options) and the first probe of a demoted replica (after 1 s), which fail.
REFUSAL_S = 1.5


def latency(stack: FaultStack, link: str) -> Fault:
    def fault() -> None:
        stack.proxies[link].delay_s = 0.05
        time.sleep(2.0)  # the streams run on through it; lifted once they end

    return fault


def reset(stack: FaultStack, link: str) -> Fault:
    def fault() -> None:
        if stack.proxies[link].reset() == 0:
            raise RuntimeError(f"no connection to reset on {link}")

    return fault


def refusal(stack: FaultStack, link: str) -> Fault:
    def fault() -> None:
        stack.proxies[link].refusing = True
        stack.proxies[link].reset()
        time.sleep(REFUSAL_S)
        stack.proxies[link].refusing = False

    return fault


def blackhole(stack: FaultStack, link: str) -> Fault:
    def fault() -> None:
        stack.proxies[link].blackhole()
        time.sleep(2.0 * stack.keepalive_timeout_s)  # past the keepalive timeout: connections are dropped
        stack.proxies[link].heal()

    return fault


def pause(stack: FaultStack, service: str) -> Fault:
    return lambda: stack.pause(service, 1.5 * stack.keepalive_timeout_s)


def kill(stack: FaultStack, service: str) -> Fault:
    return lambda: stack.restart(service)


@dataclass(frozen=True)
class Scenario:
    make: Callable[[FaultStack, str], Fault]  # called before the streams start, its fault once they have
    where: str  # the link or service it hits
    # The orchestrators the streams go to: the first, then the next each time a resuming stream breaks.
    clients: tuple[str, ...] = ("orchestrator",)
    resuming: bool = False  # the clients resume broken streams (tandem.resuming)


LINK_FAULTS = {"latency": latency, "reset": reset, "refusal": refusal, "blackhole": blackhole}
SERVICE_FAULTS = {"pause": pause, "kill": kill}
BOTH = ("orchestrator", "orchestrator-2")
# The second orchestrator drains within SHORT_SHUTDOWN_S: its streams may end with UNAVAILABLE, and only so.
CUT_SHORT = f"drain orchestrator-2 (--shutdown-timeout {SHORT_SHUTDOWN_S:g})"
SCENARIOS: dict[str, Scenario] = {
    **{f"{name} {link}": Scenario(make, link) for link in LINKS for name, make in LINK_FAULTS.items()},
    **{
        f"{name} {service}": Scenario(make, service)
        for service in ("draft", "target")
        for name, make in SERVICE_FAULTS.items()
    },
    "drain orchestrator": Scenario(drain, "orchestrator"),
    CUT_SHORT: Scenario(drain, "orchestrator-2", ("orchestrator-2",)),
    "kill orchestrator": Scenario(kill, "orchestrator", resuming=True),
    "kill orchestrator, second takes over": Scenario(takeover, "orchestrator", BOTH, resuming=True),
}


@dataclass(frozen=True)
class FaultRecord:
    scenario: str
    completed: int  # ended with every token asked for
    failed: int  # ended with an error
    hung: int  # not ended within the streams' timeout
    identical: int  # tokens equal to the run without the fault and without speculation
    token_errors: int  # completed, with tokens repeated, missing or changed
    longest_stall_s: float  # the longest wait between two chunks of a stream, from the fault on
    detected_s: float | None  # until a service logged a warning or error; None: none did
    held_requests: int  # on the target and the replica, once settled
    held_blocks: int
    exits: int  # services that exited by themselves
    drafts_again: bool
    errors: tuple[str, ...]  # the failed streams' status codes
    resumes: int = 0  # reconnections of resuming clients
    exit_code: int | None = None  # of the service a scenario signalled (killed or sent SIGTERM)
    exit_s: float | None = None  # from its signal until it exited
    back_s: float | None = None  # from its signal until it served again
    refused_s: float | None = None  # from a SIGTERM until a new request was refused


def record(stack: FaultStack, scenario: str, expected: list[list[int]]) -> FaultRecord:
    """Runs one scenario under the streams and records what it cost."""
    spec = SCENARIOS[scenario]
    fault = spec.make(stack, spec.where)
    addresses = [stack.address(name) for name in spec.clients]
    streams, began, signalled = streams_through(addresses, fault, spec.resuming)
    for proxy in stack.proxies.values():
        proxy.delay_s, proxy.refusing = 0.0, False
        proxy.heal()
    completed = [s for s in streams if s.error is None and s.done.is_set() and s.finish_reason == "length"]
    failed = [s for s in streams if s.error is not None]
    logged = [at for at, _, line in stack.logged_since(began) if " WARNING " in line or " ERROR " in line]
    held = held_after(stack.address("target"), [stack.address("draft")])
    exits = sum(service.exited() for service in stack.services.values())
    return FaultRecord(
        scenario=scenario,
        completed=len(completed),
        failed=len(failed),
        hung=sum(not s.done.is_set() for s in streams),
        identical=sum(s.tokens == want for s, want in zip(streams, expected, strict=True)),
        token_errors=sum(s.tokens != want for s, want in zip(streams, expected, strict=True) if s in completed),
        longest_stall_s=max(stream.longest_gap_after(began) for stream in streams),
        detected_s=logged[0] - began if logged else None,
        held_requests=held[0],
        held_blocks=held[1],
        exits=exits,
        drafts_again=drafts_again(stack),
        errors=tuple(sorted(code_of(s.error) for s in failed)),
        resumes=sum(stream.resumes for stream in streams),
        exit_code=None if signalled is None else signalled.exit_code,
        exit_s=None if signalled is None else signalled.exit_s,
        back_s=None if signalled is None else signalled.back_s,
        refused_s=None if signalled is None else signalled.refused_s,
    )


def code_of(error: object) -> str:
    code = getattr(error, "code", None)
    return code().name if callable(code) else type(error).__name__


def lost(r: FaultRecord) -> list[str]:
    """What a scenario's record shows lost. Every stream completes with the tokens of a fault-free run, but under a
    SIGTERM with a short timeout, where those still running end with UNAVAILABLE; a SIGTERM is answered by refusing
    new requests within a second and exiting 0."""
    problems = [f"{r.hung} hung"] if r.hung else []
    if r.scenario == CUT_SHORT:
        problems += [f"errors other than UNAVAILABLE: {r.errors}"] if set(r.errors) - {"UNAVAILABLE"} else []
    else:
        problems += [f"{STREAMS - r.completed} not completed"] if r.completed < STREAMS else []
        problems += [f"{STREAMS - r.identical} not identical"] if r.identical < STREAMS else []
    problems += [f"{r.token_errors} with tokens wrong"] if r.token_errors else []
    problems += (
        [f"{r.held_requests} requests and {r.held_blocks} blocks held"] if r.held_requests or r.held_blocks else []
    )
    problems += [f"{r.exits} services exited"] if r.exits else []
    problems += [] if r.drafts_again else ["no drafts afterwards"]
    if r.scenario.startswith("drain"):
        problems += [] if r.exit_code == 0 else [f"exit code {r.exit_code} after SIGTERM"]
        refused = r.refused_s is not None and r.refused_s < 1.0
        problems += [] if refused else [f"new requests not refused within 1 s of SIGTERM ({r.refused_s})"]
    return problems


def drafts_again(stack: FaultStack, timeout_s: float = 60.0) -> bool:
    """Whether a new request gets drafts within `timeout_s` (a demoted replica rejoins on its next probe)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = completion(stack.address("orchestrator"), input_ids=[1, 2, 3], max_new_tokens=8, ignore_eos=True)
        if answer.stats.draft_tokens > 0:
            return True
        time.sleep(0.2)
    return False


@dataclass(frozen=True)
class FaultRun:
    settings: dict[str, str]
    records: list[FaultRecord]


def run_faults(target_dir: Path, draft_dir: Path, keepalive_timeout_s: float, scenarios: list[str]) -> FaultRun:
    """Starts the stack, takes the fault-free reference, then runs each scenario; prints a line per scenario."""
    stack = FaultStack(target_dir, draft_dir, keepalive_timeout_s).start()
    try:
        expected = target_only(stack.address("orchestrator"))
        records = []
        for scenario in scenarios:
            records.append(record(stack, scenario, expected))
            print(f"tandem bench-faults: {row(records[-1])}", flush=True)
    finally:
        stack.close()
    settings = {
        "target": shown(target_dir),
        "draft": shown(draft_dir),
        "streams": f"{STREAMS} (8 greedy, 2 seeded at temperature 0.8), {NEW_TOKENS} tokens each",
        "flags": " ".join([*CACHE_FLAGS, *ORCHESTRATOR_FLAGS, "--keepalive-timeout", str(keepalive_timeout_s)]),
    }
    return FaultRun(settings, records)


COLUMNS = (
    "| scenario | completed | failed | hung | identical | tokens wrong | resumed | longest stall | detected | held "
    "| exits | drafts again | signalled service |"
)


def row(r: FaultRecord) -> str:
    detected = "-" if r.detected_s is None else f"{r.detected_s:.1f} s"
    failed = f"{r.failed} ({', '.join(sorted(set(r.errors)))})" if r.failed else "0"
    held = f"{r.held_requests} req, {r.held_blocks} blocks" if r.held_requests or r.held_blocks else "0"
    return (
        f"| {r.scenario} | {r.completed}/{STREAMS} | {failed} | {r.hung} | {r.identical}/{STREAMS} | {r.token_errors} "
        f"| {r.resumes} | {r.longest_stall_s:.1f} s | {detected} | {held} | {r.exits} "
        f"| {'yes' if r.drafts_again else 'NO'} | {signalled(r)} |"
    )


def signalled(r: FaultRecord) -> str:
    """The signalled service's exit code, when it served again, and after a SIGTERM when it refused new requests."""
    if r.back_s is None:
        return "-"
    refused = "" if r.refused_s is None else f", refused new requests after {r.refused_s:.2f} s"
    return f"exit {r.exit_code} after {r.exit_s or 0.0:.1f} s, serving again after {r.back_s:.1f} s{refused}"


def write_report(run: FaultRun, out: Path) -> Path:
    """latest.json and latest.md under `out`; returns the table's path."""
    out.mkdir(parents=True, exist_ok=True)
    document = {"settings": run.settings, "records": [asdict(r) for r in run.records]}
    (out / "latest.json").write_text(json.dumps(document, indent=1) + "\n")
    lines = [f"- {name}: {value}" for name, value in run.settings.items()]
    lines += ["", COLUMNS, "|" + "---|" * COLUMNS.count(" | ") + "---|", *(row(r) for r in run.records)]
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    return out / "latest.md"
