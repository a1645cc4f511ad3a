"""Faults between the services cost only time: every scenario of `tandem bench-faults` (bench.faults) on one stack
whose three links run through fault proxies, each under 8 greedy and 2 seeded sampled streams: 50 ms of latency, a
reset of every connection, refused connections or a blackhole on each link; the replica or the target paused, or
killed and started again at its address; the orchestrator killed and started again. Every stream ends with the tokens
of a run without the fault and without speculation (a killed orchestrator fails its own streams, UNAVAILABLE, and
nothing else); nothing stays held; no service exits by itself; the replica drafts again after. Then the command.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fault_stack import FaultStack
from bench.fault_streams import STREAMS, target_only
from bench.faults import SCENARIOS, FaultRecord, lost, record
from tests.integration.stack import run_to_exit

KEEPALIVE_S = 2.0  # every service's --keepalive-timeout (10 s by default: tests/unit/test_grpc_keepalive.py)


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[tuple[FaultStack, list[list[int]]]]:
    stack = FaultStack(llama_target, random_draft, KEEPALIVE_S).start()
    try:
        yield stack, target_only(stack.address("orchestrator"))
    finally:
        stack.close()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_fault_between_the_services_costs_only_time(stack: tuple[FaultStack, list[list[int]]], scenario: str) -> None:
    services, expected = stack
    result = record(services, scenario, expected)
    assert (result.hung, result.token_errors, result.exits) == (0, 0, 0), result
    assert (result.held_requests, result.held_blocks) == (0, 0), result
    assert result.drafts_again, result
    if scenario == "kill orchestrator":
        assert (result.failed, set(result.errors)) == (STREAMS, {"UNAVAILABLE"}), result
    else:
        assert (result.completed, result.failed, result.identical) == (STREAMS, 0, STREAMS), result
        assert result.longest_stall_s < 15.0, result  # a restart, or the keepalive timeout, plus 10 s at most
    if scenario.startswith(("blackhole", "pause")):
        # Silence is noticed within the keepalive timeout, and logged.
        assert result.detected_s is not None and result.detected_s <= KEEPALIVE_S + 1.0, result
    assert lost(result) == []


def test_lost_names_what_a_record_shows_lost() -> None:
    whole = FaultRecord("kill draft", 10, 0, 0, 10, 0, 0.5, 0.1, 0, 0, 0, True, ())
    assert lost(whole) == []
    broken = FaultRecord("kill draft", 9, 1, 0, 9, 0, 0.5, 0.1, 1, 3, 1, False, ("UNAVAILABLE",))
    assert lost(broken) == [
        "1 not completed",
        "1 not identical",
        "1 requests and 3 blocks held",
        "1 services exited",
        "no drafts afterwards",
    ]
    orchestrator = FaultRecord("kill orchestrator", 0, 10, 0, 0, 0, 0.0, 1.0, 0, 0, 0, True, ("UNAVAILABLE",) * 10)
    assert lost(orchestrator) == []


def test_the_command_prints_and_writes_the_table(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    arguments = ["bench-faults", "--target", str(llama_target), "--draft", str(random_draft), "--out", str(tmp_path)]
    finished = run_to_exit([*arguments, "--keepalive-timeout", "2", "--scenarios", "reset replica-target"])
    assert finished.returncode == 0, finished.stdout
    table = (tmp_path / "latest.md").read_text()
    assert "| scenario | completed | failed | hung | identical |" in table
    assert "| reset replica-target | 10/10 | 0 | 0 | 10/10 | 0 |" in table and table in finished.stdout
    assert "--keepalive-timeout 2.0" in table
