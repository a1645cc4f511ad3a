"""`python -m bench.trace` on the tiny pair: the services it starts load its hook, and every hop of a round's
critical path is found in their logs. No timing is asserted (speed lives in the recorded results)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

from bench.trace import CRITICAL_PATH, ORCHESTRATOR_SIDE
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_eagle3, write_tiny_target


def test_the_trace_follows_rounds_through_every_process(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec(max_position_embeddings=4096))
    draft = write_tiny_eagle3(tmp_path / "draft", target)
    out = tmp_path / "trace"
    # A fixed k: adaptive k would soon ask the random draft for nothing, and rounds without drafts push none.
    bench = ["--target", str(target), "--draft", str(draft), "--no-adaptive-k", "--num-prompts", "2"]
    bench += ["--max-new-tokens", "24", "--concurrency", "1", "--repeats", "1", "--no-transformers", "--no-colocated"]
    finished = subprocess.run(
        [sys.executable, "-m", "bench.trace", "--trace-out", str(out), *bench],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert finished.returncode == 0, finished.stdout
    summary = json.loads((out / "latest.json").read_text())
    assert summary["rounds"] >= 2
    assert summary["bench_args"] == bench
    assert [(hop["from"], hop["to"]) for hop in summary["critical_path"]] == list(itertools.pairwise(CRITICAL_PATH))
    assert [(hop["from"], hop["to"]) for hop in summary["orchestrator_side"]] == list(
        itertools.pairwise(ORCHESTRATOR_SIDE)
    )
    for hop in summary["critical_path"]:
        assert 0 <= hop["median_ms"] <= hop["p90_ms"]
    assert abs(summary["compute_ms"] + summary["outside_compute_ms"] - summary["round_ms"]) < 0.01
    assert "| draft:draft_start | draft:draft_end (compute) |" in (out / "latest.md").read_text()
