"""`tandem bench` run as a user runs it, on the tiny pair: a real split stack, the colocated engine, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import run_to_exit


@pytest.fixture(scope="module")
def long_context_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The held-out prompts are source files: the tiny tokenizer makes hundreds of tokens of them."""
    target = write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(max_position_embeddings=4096))
    draft = write_tiny_eagle3(tmp_path_factory.mktemp("draft"), target, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    return target, draft


def test_bench_writes_the_report_with_medians_and_identical_outputs(
    tmp_path: Path, long_context_pair: tuple[Path, Path]
) -> None:
    target, draft = long_context_pair
    out = tmp_path / "results"
    arguments = ["bench", "--target", str(target), "--draft", str(draft), "--out", str(out)]
    arguments += ["--num-prompts", "2", "--max-new-tokens", "8", "--concurrency", "1", "2", "--repeats", "2"]
    finished = run_to_exit(arguments, timeout_s=600)
    assert finished.returncode == 0, finished.stdout

    document = json.loads((out / "latest.json").read_text())
    assert document["settings"]["repeats"] == 2
    rows = {(row["setup"], row["concurrency"]): row for row in document["summary"]}
    assert set(rows) == {("split", 1), ("split", 2), ("colocated", 1), ("colocated", 2)}
    for (setup, _), row in rows.items():
        # Greedy speculative decoding in float32 gives the target's own completions, in both setups.
        assert row["identical_outputs"] == "2/2"
        assert len(row["tokens_per_second_runs"]) == len(row["target_only_tokens_per_second_runs"]) == 2
        assert row["tokens_per_second"] in row["tokens_per_second_runs"]  # a median of two is one of the runs
        assert row["speedup"] > 0
        assert (row["split_over_colocated"] is not None) == (setup == "split")
        assert 1.0 <= row["mean_acceptance_length"] <= 6.0
    # 2 setups x 2 concurrencies x 2 repeats x (speculative, target-only), each over both prompts, 8 tokens each.
    assert len(document["runs"]) == 16
    for run in document["runs"]:
        assert sorted(request["prompt_index"] for request in run["requests"]) == [0, 1]
        assert all(len(request["token_ids"]) == 8 for request in run["requests"])

    table = (out / "latest.md").read_text()
    assert "median of 2 runs each" in table
    assert table.count("| split |") == 2 and table.count("| colocated |") == 2
    assert (out / "acceptance_per_position.png").read_bytes().startswith(b"\x89PNG")
    assert finished.stdout.strip().endswith(table.strip().splitlines()[-1])


def test_bench_refuses_zero_repeats(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    finished = run_to_exit(["bench", "--target", str(llama_target), "--draft", str(random_draft), "--repeats", "0"])
    assert finished.returncode != 0
    assert "--repeats must be at least 1, got 0" in finished.stdout
