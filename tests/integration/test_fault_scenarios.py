"""Faults cost only time: every scenario of `tandem bench-faults` (bench.faults) on one stack whose three links run
through fault proxies, each under 8 greedy and 2 seeded sampled streams: 50 ms of latency, a reset of every
connection, refused connections or a blackhole on each link; the replica or the target paused, or killed and started
again at its address; the orchestrator sent SIGTERM (it drains), SIGTERM with a short --shutdown-timeout, killed and
started again, or killed while a second orchestrator serves. Every stream ends with the tokens of a run without the
fault and without speculation: resuming clients complete across a killed orchestrator within its restart time plus
10 s; only the short drain may end streams, with UNAVAILABLE. A SIGTERM is answered by refusing new requests within a
second and exiting 0. Nothing stays held; no service exits by itself; the replica drafts again after. The command runs
once, every scenario in turn; each test reads its scenario's record from the report.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.fault_streams import STREAMS
from bench.faults import CUT_SHORT, SCENARIOS, FaultRecord, lost
from tests.integration.stack import run_to_exit

# Every scenario but the orchestrator killed and started again at its address, whose resumes are those of the one
# where the second orchestrator takes over (the full command, recorded in bench/results/faults, runs it too): 12 s.
TESTED = [scenario for scenario in SCENARIOS if scenario != "kill orchestrator"]
# Every service's --keepalive-timeout: the least it takes (10 s by default: tests/unit/test_grpc_keepalive.py), so
# that each blackhole (twice this) and pause (1.5 times) is over soon.
KEEPALIVE_S = 1.0


@pytest.fixture(scope="module")
def command(
    llama_target: Path, random_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`tandem bench-faults` once, every scenario on one stack: its run and the directory of its report."""
    out = tmp_path_factory.mktemp("bench-faults")
    arguments = ["bench-faults", "--target", str(llama_target), "--draft", str(random_draft), "--out", str(out)]
    arguments += ["--keepalive-timeout", str(KEEPALIVE_S), "--scenarios", *TESTED]
    return run_to_exit(arguments, timeout_s=900), out


@pytest.fixture(scope="module")
def records(command: tuple[subprocess.CompletedProcess[str], Path]) -> dict[str, FaultRecord]:
    finished, out = command
    assert (out / "latest.json").exists(), finished.stdout
    document = json.loads((out / "latest.json").read_text())
    return {r["scenario"]: FaultRecord(**{**r, "errors": tuple(r["errors"])}) for r in document["records"]}


@pytest.mark.parametrize("scenario", TESTED)
def test_a_fault_costs_only_time(records: dict[str, FaultRecord], scenario: str) -> None:
    result = records[scenario]
    assert (result.hung, result.token_errors, result.exits) == (0, 0, 0), result
    assert (result.held_requests, result.held_blocks) == (0, 0), result
    assert result.drafts_again, result
    if scenario == CUT_SHORT:
        assert result.failed >= 1 and set(result.errors) == {"UNAVAILABLE"}, result
        assert result.completed + result.failed == STREAMS, result
    else:
        assert (result.completed, result.failed, result.identical) == (STREAMS, 0, STREAMS), result
        # A restart, or the keepalive timeout, plus 10 s at most.
        assert result.longest_stall_s < max(5.0, result.back_s or 0.0) + 10.0, result
    if SCENARIOS[scenario].resuming:
        assert result.resumes >= STREAMS, result  # every stream broke and was resumed
    if scenario.startswith("drain"):
        assert result.exit_code == 0 and result.refused_s is not None and result.refused_s < 1.0, result
        assert result.exit_s is not None and result.exit_s < 30.0, result  # within --shutdown-timeout
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
    cut = FaultRecord(CUT_SHORT, 4, 6, 0, 4, 0, 0.5, 0.1, 0, 0, 0, True, ("UNAVAILABLE",) * 6, 0, 0, 0.6, 3.0, 0.01)
    assert lost(cut) == []
    slow = FaultRecord("drain orchestrator", 10, 0, 0, 10, 0, 0.5, None, 0, 0, 0, True, (), 0, 1, 2.0, 3.0, 1.5)
    assert lost(slow) == ["exit code 1 after SIGTERM", "new requests not refused within 1 s of SIGTERM (1.5)"]
    killed = FaultRecord("kill orchestrator", 0, 10, 0, 0, 0, 0.0, 1.0, 0, 0, 0, True, ("UNAVAILABLE",) * 10)
    assert lost(killed) == ["10 not completed", "10 not identical"]


def test_the_command_prints_and_writes_the_table(command: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    finished, out = command
    assert finished.returncode == 0, finished.stdout
    table = (out / "latest.md").read_text()
    assert "| scenario | completed | failed | hung | identical |" in table and table in finished.stdout
    assert "| reset replica-target | 10/10 | 0 | 0 | 10/10 | 0 |" in table
    assert f"--keepalive-timeout {KEEPALIVE_S}" in table
    assert len([line for line in table.splitlines() if line.startswith("| ")]) == 1 + len(TESTED)
