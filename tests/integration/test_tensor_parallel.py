"""`tandem target --tp N` as a process: its ranks never outlive it, and a tp that does not fit is refused at start-up.

Greedy outputs at tp 2 are checked through the whole stack in test_greedy_equivalence.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.integration.stack import READY_TIMEOUT_S, run_to_exit, tandem_command

GONE_TIMEOUT_S = 10.0
RANK_STARTED = re.compile(r"started target rank 1/2 \(pid (\d+)\)")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(vocab_size=333, num_layers=2))


def is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (exited, not yet reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_rank_exits_when_rank_0_is_killed(target: Path, tmp_path: Path) -> None:
    log_path, ready_file = tmp_path / "target.log", tmp_path / "address"
    arguments = ["target", "--model", str(target), "--tp", "2", "--port", "0", "--ready-file", str(ready_file)]
    with log_path.open("w") as log:
        rank_0 = subprocess.Popen(tandem_command(*arguments), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready_file.exists() or rank_0.poll() is not None, READY_TIMEOUT_S, "target not ready")
        assert ready_file.exists(), log_path.read_text()
        match = RANK_STARTED.search(log_path.read_text())
        assert match is not None, log_path.read_text()
        rank_1 = int(match.group(1))
        assert is_running(rank_1)
        rank_0.send_signal(signal.SIGKILL)  # no chance to stop its ranks itself
        rank_0.wait()
        wait_until(lambda: not is_running(rank_1), GONE_TIMEOUT_S, f"rank 1 (pid {rank_1}) outlived rank 0")
    finally:
        rank_0.kill()
        rank_0.wait()


def test_tp_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(target: Path) -> None:
    result = run_to_exit(["target", "--model", str(target), "--tp", "3", "--port", "0"])
    assert result.returncode == 2, result.stdout
    assert "tp 3 does not divide num_attention_heads 4" in result.stdout
    assert "started target rank" not in result.stdout
