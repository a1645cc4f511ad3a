"""bench.cpu: CPU seconds by process role, read from real processes (this one and a child that burns CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.cpu import OWN_PROCESS, CpuMeter, spent


def test_a_process_trees_seconds_are_summed_by_the_role_its_command_line_names() -> None:
    # A child run as `python -c ... launch.cli draft`: its role is the word after launch.cli, as for the services.
    burn = "import sys, time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ninput()"
    child = subprocess.Popen(
        [sys.executable, "-c", burn, "launch.cli", "draft"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    try:
        meter = CpuMeter(child.pid, tree=True)
        start = {"draft": 0.0}  # the child's seconds count from its start
        assert set(meter.sample()) == {"draft"}
        # It burns 0.3 s of CPU, then waits for its input: the meter sees those seconds.
        deadline = time.monotonic() + 60
        while spent(start, meter.sample())["draft"] < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.3 <= spent(start, meter.sample())["draft"] < 5.0
    finally:
        child.communicate(b"\n", timeout=30)
    assert spent({"draft": 0.1}, {"draft": 0.4, "target": 0.2}) == {"draft": 0.4 - 0.1, "target": 0.2}
    assert spent({"draft": 0.5}, {"draft": 0.4}) == {"draft": 0.0}  # never negative


def test_a_single_process_is_one_role() -> None:
    meter = CpuMeter(os.getpid(), tree=False)
    before = meter.sample()
    total = 0
    for number in range(2_000_000):
        total += number
    assert total > 0
    after = meter.sample()
    assert set(after) == {OWN_PROCESS} and after[OWN_PROCESS] > before[OWN_PROCESS]
