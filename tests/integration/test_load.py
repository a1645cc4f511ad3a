"""`tandem bench-load` run as a user runs it, small: a real `tandem serve` on the tiny pair, a pool that forces
preemption, every stream to its end, memory of every process, KV pools whole again."""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.stack import run_to_exit

STREAMS = 24


def test_bench_load_finishes_every_stream_with_a_pool_far_below_the_demand(
    tmp_path: Path, llama_target: Path, random_draft: Path
) -> None:
    out = tmp_path / "load"
    arguments = ["bench-load", "--target", str(llama_target), "--draft", str(random_draft), "--output-dir", str(out)]
    # The longest stream (40 + 64 tokens) takes 7 blocks of 16; all of them together take several times 12, and
    # each grows by 2 to 4 blocks while it decodes, more than the block of headroom admission leaves it.
    arguments += ["--streams", str(STREAMS), "--prompt-tokens", "8", "40", "--max-new-tokens", "32", "64"]
    arguments += ["--kv-blocks", "12", "--timeout", "300"]
    finished = run_to_exit(arguments, timeout_s=600)
    assert finished.returncode == 0, finished.stdout

    assert sorted(path.name for path in out.iterdir()) == ["latest.json", "latest.md"]
    assert (out / "latest.json").stat().st_size < 16 * 1024
    document = json.loads((out / "latest.json").read_text())
    assert (document["streams"], document["succeeded"], document["errors"]) == (STREAMS, STREAMS, {})
    pool = document["kv_pool"]
    assert pool["blocks"] == 12 and pool["demand_blocks"] >= 3 * 12
    assert document["preemptions"] > 0  # the pool ran dry and the newest requests made room
    # ignore_eos: every stream got its whole budget (a short one would be an INCOMPLETE error).
    assert document["completion_tokens"] >= 32 * STREAMS and document["tokens_per_second"] > 0
    for key in ("ttft_seconds", "e2e_seconds"):
        latency = document[key]
        assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert document["ttft_seconds"]["p50"] <= document["e2e_seconds"]["max"]

    memory = {process["process"]: process for process in document["memory"]}
    assert list(memory)[:4] == ["serve", "target", "draft-0", "orchestrator"]
    for process in memory.values():
        assert process["samples"] >= 2
        assert 0 < process["rss_start_mib"] <= process["rss_peak_mib"]
        assert process["vm_hwm_mib"] is None or process["vm_hwm_mib"] > 0
    # The services hold a model each: far more than the launcher, which only waits on them.
    assert memory["target"]["rss_peak_mib"] > memory["serve"]["rss_peak_mib"]

    states = {state["service"]: state for state in document["kv_blocks"]}
    assert set(states) == {"target", "draft-0"}
    assert document["kv_blocks_back"] is True
    for state in states.values():
        assert state["free"] == state["total"] == 12 and state["running_requests"] == 0

    table = (out / "latest.md").read_text()
    assert f"| {STREAMS} | {STREAMS} | none | 12 x 16 tokens |" in table
    assert "| time to first token |" in table and "| end to end |" in table
    for name in ("serve", "target", "draft-0", "orchestrator"):
        assert f"| {name} |" in table
    assert "KV blocks at the end: all blocks back." in table
    assert finished.stdout.strip().endswith("KV blocks at the end: all blocks back.")


def test_bench_load_refuses_a_pool_that_cannot_hold_its_longest_stream(llama_target: Path, random_draft: Path) -> None:
    arguments = ["bench-load", "--target", str(llama_target), "--draft", str(random_draft), "--kv-blocks", "2"]
    finished = run_to_exit([*arguments, "--prompt-tokens", "8", "60", "--max-new-tokens", "4", "24"])
    assert finished.returncode != 0
    assert (
        "--kv-blocks 2: the longest stream (60 prompt + 24 new tokens) needs 6 blocks of 16 tokens" in finished.stdout
    )


def test_bench_load_refuses_a_reversed_range(llama_target: Path, random_draft: Path) -> None:
    arguments = ["bench-load", "--target", str(llama_target), "--draft", str(random_draft)]
    finished = run_to_exit([*arguments, "--max-new-tokens", "24", "4"])
    assert finished.returncode != 0
    assert "--max-new-tokens takes MIN MAX with 1 <= MIN <= MAX, got 24 4" in finished.stdout
