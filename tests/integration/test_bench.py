"""`tandem bench` run as a user runs it, on the tiny pair: a real split stack, the colocated engine, the report."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.profile import read_raw
from tandem.settings import DEMO_CHAT_TEMPLATE, SERVICE_ENVIRONMENT
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import run_to_exit


@pytest.fixture(scope="module")
def long_context_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The held-out prompts are source files: the tiny tokenizer makes hundreds of tokens of them."""
    target = write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(max_position_embeddings=4096))
    draft = write_tiny_eagle3(tmp_path_factory.mktemp("draft"), target, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    return target, draft


def test_bench_writes_the_report_with_medians_transformers_rows_and_identical_outputs(
    tmp_path: Path, long_context_pair: tuple[Path, Path]
) -> None:
    target, draft = long_context_pair
    out = tmp_path / "results"
    requests = tmp_path / "requests.json"
    arguments = ["bench", "--target", str(target), "--draft", str(draft), "--out", str(out)]
    # A fixed k: the random draft would soon be asked for nothing (adaptive k), and the report's per-position
    # acceptance is what is checked here.
    arguments += ["--no-adaptive-k", "--num-prompts", "2", "--max-new-tokens", "8", "--concurrency", "1", "2"]
    arguments += ["--repeats", "2"]
    arguments += ["--save-requests", str(requests)]
    finished = run_to_exit(arguments, timeout_s=600)
    assert finished.returncode == 0, finished.stdout

    # The summary holds aggregates only: it stays small whatever the prompt count and token budget.
    assert (out / "latest.json").stat().st_size < 16 * 1024
    assert sorted(path.name for path in out.iterdir()) == ["acceptance_per_position.png", "latest.json", "latest.md"]
    document = json.loads((out / "latest.json").read_text())
    assert set(document) == {"settings", "summary", "transformers"}
    assert document["settings"]["repeats"] == 2
    assert "CPUs" in document["settings"]["machine"] and "transformers" in document["settings"]["machine"]
    # The benchmark process (colocated engine, transformers) runs under the services' OpenMP environment.
    runtime = document["settings"]["runtime"]
    assert runtime["GOMP_SPINCOUNT"] == os.environ.get("GOMP_SPINCOUNT", SERVICE_ENVIRONMENT["GOMP_SPINCOUNT"])
    assert runtime["torch_threads"] >= 1
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
        assert len(row["acceptance_per_position"]) == 5
        timing = row["per_round_ms"]
        compute = timing["verify"] + timing["draft"] + timing["drafted_ahead"]
        assert timing["request"] >= timing["verify"] + timing["draft"]  # the client waited for the compute
        assert timing["request"] >= timing["round"] > 0
        assert row["outside_compute_ms_per_round"] == pytest.approx(max(0.0, timing["round"] - compute), abs=2e-3)
        # Per token decoded after the first, of both runs: a speculative round decodes at least one token (equal
        # when none was accepted; the per-round figure comes from rounded phases, so a few us apart).
        per_token = row["outside_compute_ms_per_token"]
        assert set(per_token) == {"speculative", "target_only"} and min(per_token.values()) >= 0
        assert per_token["speculative"] <= row["outside_compute_ms_per_round"] + 5e-3
        assert row["vs_transformers_greedy"] > 0 and row["vs_transformers_prompt_lookup"] > 0
        assert row["target_only_vs_transformers_greedy"] > 0
        # CPU time by process: the split stack's three services (a target-only run leaves the replica idle but for
        # its event loop), the colocated engine's one process; every measured run kept some core busy. The kernel
        # counts CPU time in clock ticks (10 ms): in a run of 16 tokens one process may show none (the orchestrator
        # did, once), so only the stack's total must be above 0 (tests/unit/test_bench_cpu.py checks the counts).
        cpu = row["cpu"]
        speculative, target_only = cpu["speculative"]["ms_per_token"], cpu["target_only"]["ms_per_token"]
        if setup == "split":
            assert {"target", "draft", "orchestrator"} <= set(speculative) and "target" in target_only
            assert all(ms >= 0 for ms in (*speculative.values(), *target_only.values()))
            assert sum(speculative.values()) > 0 and sum(target_only.values()) > 0
        else:
            assert set(speculative) == set(target_only) == {"process"}
            assert speculative["process"] > 0
        assert cpu["speculative"]["cores_busy"] > 0 and cpu["target_only"]["cores_busy"] > 0

    hf = {row["setup"]: row for row in document["transformers"]}
    assert set(hf) == {"transformers greedy", "transformers prompt-lookup"}
    for row in hf.values():
        assert row["concurrency"] == 1 and row["batch"] == "1, sequential"
        # Batch 1 in every repeat at each of the two concurrencies: interleaved with Tandem's runs.
        assert len(row["tokens_per_second_runs"]) == 4
        assert row["tokens_per_second"] in row["tokens_per_second_runs"]
        # transformers' greedy completions (and prompt lookup's, lossless) are Tandem's target-only ones.
        assert row["identical_to_tandem_target_only"] == "2/2"
    assert hf["transformers greedy"]["vs_transformers_greedy"] == 1.0
    assert hf["transformers prompt-lookup"]["vs_transformers_prompt_lookup"] == 1.0
    split = rows[("split", 1)]
    greedy_rate = hf["transformers greedy"]["tokens_per_second"]
    assert split["vs_transformers_greedy"] == pytest.approx(split["tokens_per_second"] / greedy_rate, rel=1e-2)

    # Per-request records only where asked: 2 setups x 2 concurrencies x 2 repeats x (speculative, target-only),
    # and 2 transformers methods x 2 concurrencies x 2 repeats, each over both prompts, 8 tokens each.
    detail = json.loads(requests.read_text())
    assert len(detail["runs"]) == 16 + 8
    assert sum(run["label"].startswith("transformers") for run in detail["runs"]) == 8
    for run in detail["runs"]:
        assert sorted(request["prompt_index"] for request in run["requests"]) == [0, 1]
        assert all(len(request["token_ids"]) == 8 for request in run["requests"])
    # Which of a setup's two runs goes first alternates repeat by repeat (the first one meets cold processes).
    for label in ("split", "colocated"):
        for concurrency in (1, 2):
            order = [r["speculative"] for r in detail["runs"] if (r["label"], r["concurrency"]) == (label, concurrency)]
            assert order == [True, False, False, True], (label, concurrency)

    table = (out / "latest.md").read_text()
    assert "median of 2 runs each" in table
    assert "| vs HF greedy | vs HF prompt-lookup |" in table
    assert "| outside compute ms/round (per token: speculative / target-only) |" in table
    assert " CPU ms per token by process (cores busy): speculative / target-only |" in table
    assert any(line.startswith("| split |") and "target " in line and "draft " in line for line in table.splitlines())
    assert table.count("| split |") == 2 and table.count("| colocated |") == 2
    assert "| transformers greedy | 1 (batch 1, sequential) |" in table
    assert "| transformers prompt-lookup | 1 (batch 1, sequential) |" in table
    header, rule = [line for line in table.splitlines() if line.startswith("|")][:2]
    assert header.count("|") == rule.count("|")
    assert (out / "acceptance_per_position.png").read_bytes().startswith(b"\x89PNG")
    assert finished.stdout.strip().endswith(table.strip().splitlines()[-1])


def test_bench_profile_samples_each_service_by_phase(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    out = tmp_path / "profile"
    arguments = ["bench-profile", "--target", str(llama_target), "--draft", str(random_draft), "--out", str(out)]
    finished = run_to_exit([*arguments, "--num-prompts", "1", "--max-new-tokens", "24"], timeout_s=600)
    assert finished.returncode == 0, finished.stdout
    report = (out / "latest.md").read_text()
    assert "### target-only: 24 tokens, " in report and "### speculative: 24 tokens, " in report
    assert "| ms per token | target | draft | orchestrator |" in report
    # py-spy saw the target's model code run in both modes, and the replica's only when it drafted.
    assert read_raw((out / "target-only-target.txt").read_text())["model forward"] > 0
    assert read_raw((out / "speculative-target.txt").read_text())["model forward"] > 0
    assert read_raw((out / "speculative-draft.txt").read_text())["model forward"] > 0
    target_only = report.split("### speculative")[0]
    forward = next(line for line in target_only.splitlines() if line.startswith("| model forward |"))
    assert float(forward.split("|")[2]) > 0.0  # the target's forward took time per token
    on_core = next(line for line in target_only.splitlines() if line.startswith("| on a core, in all |"))
    assert float(on_core.split("|")[2]) > 0.0


def test_bench_refuses_zero_repeats(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    finished = run_to_exit(["bench", "--target", str(llama_target), "--draft", str(random_draft), "--repeats", "0"])
    assert finished.returncode != 0
    assert "--repeats must be at least 1, got 0" in finished.stdout


def test_bench_kinds_measures_each_draft_kind_beside_one_target_only_and_transformers(
    tmp_path: Path, long_context_pair: tuple[Path, Path]
) -> None:
    target, draft = long_context_pair
    out = tmp_path / "results"
    arguments = ["bench", "--target", str(target), "--draft", str(draft), "--out", str(out)]
    arguments += ["--kinds", "chain", "tree", "ngram", "hybrid", "--no-adaptive-k", "--speculative-num-steps", "3"]
    arguments += ["--num-prompts", "2", "--max-new-tokens", "6", "--concurrency", "1"]
    finished = run_to_exit(arguments, timeout_s=900)
    assert finished.returncode == 0, finished.stdout

    document = json.loads((out / "latest.json").read_text())
    assert (out / "latest.json").stat().st_size < 16 * 1024
    kinds = document["settings"]["draft_kinds"]
    assert list(kinds) == ["chain", "tree", "ngram", "hybrid"]
    assert kinds["chain"].endswith(" chain") and kinds["tree"].endswith(" tree of topk 4, 7 drafts")
    assert "n-gram branch (suffixes of 4 down to 3 tokens)" in kinds["hybrid"]
    assert kinds["ngram"] == "n-gram drafts (suffixes of 4 down to 1 tokens)"
    rows = {(row["setup"], row["draft"]): row for row in document["summary"]}
    assert set(rows) == {(setup, kind) for setup in ("split", "colocated") for kind in kinds}
    for (setup, kind), row in rows.items():
        assert row["identical_outputs"] == "2/2", (setup, kind)
        # One target-only run per setup is every kind's reference; transformers ran in the same run.
        assert row["target_only_tokens_per_second"] == rows[(setup, "chain")]["target_only_tokens_per_second"]
        assert row["speedup"] > 0 and row["vs_transformers_greedy"] > 0
        assert len(row["acceptance_per_position"]) <= 3  # per depth, trees included
    assert {row["setup"] for row in document["transformers"]} == {"transformers greedy", "transformers prompt-lookup"}
    table = (out / "latest.md").read_text()
    for name in ("split chain", "split tree", "split ngram", "split hybrid", "colocated hybrid"):
        assert f"| {name} | 1 |" in table
    assert "draft kinds: chain: " in table


def test_bench_kinds_refuses_what_names_a_kind_another_way(tmp_path: Path, llama_target: Path) -> None:
    for extra in (["--draft", "ngram"], ["--hybrid-ngram"], ["--address", "127.0.0.1:1"]):
        finished = run_to_exit(["bench", "--target", str(llama_target), "--kinds", "chain", *extra])
        assert finished.returncode != 0
        assert "--kinds names the draft kinds" in finished.stdout, extra


def test_bench_structured_puts_constrained_rows_beside_free_ones(
    tmp_path: Path, long_context_pair: tuple[Path, Path]
) -> None:
    """Draft kinds under structured output are tests/integration/test_structured_kinds.py's; here, the report."""
    target, draft = long_context_pair
    out = tmp_path / "results"
    arguments = ["bench", "--target", str(target), "--draft", str(draft), "--out", str(out), "--structured"]
    arguments += ["--no-adaptive-k", "--speculative-num-steps", "3", "--num-prompts", "3", "--max-new-tokens", "24"]
    arguments += ["--concurrency", "2", "--no-transformers"]
    finished = run_to_exit(arguments, timeout_s=600)
    assert finished.returncode == 0, finished.stdout

    document = json.loads((out / "latest.json").read_text())
    rows = {(row["setup"], row["constraint"]): row for row in document["summary"]}
    assert set(rows) == {(setup, constraint) for setup in ("split", "colocated") for constraint in ("", "json schema")}
    for key, row in rows.items():
        # Constrained greedy speculation gives the constrained target-only completions.
        assert row["identical_outputs"] == "3/3", key
    for setup in ("split", "colocated"):
        free, constrained = rows[(setup, "")], rows[(setup, "json schema")]
        # Each is measured against its own target-only run: the constrained one ran with the schemas.
        assert constrained["target_only_tokens_per_second_runs"] != free["target_only_tokens_per_second_runs"]
    table = (out / "latest.md").read_text()
    assert "| split json schema | 2 |" in table and "rows named json schema" in table
    # --no-transformers: no transformers rows, and no ratios to them.
    assert document["settings"]["transformers"] is False and document["transformers"] == []
    for row in rows.values():
        assert row["vs_transformers_greedy"] is None and row["vs_transformers_prompt_lookup"] is None
        assert row["target_only_vs_transformers_greedy"] is None
    assert "transformers greedy" not in table


def test_bench_mixed_measures_each_class_against_its_own_target_only(
    tmp_path: Path, long_context_pair: tuple[Path, Path]
) -> None:
    """`tandem bench-mixed` on a tiny pair through the HTTP API and the official client: a row per class, outputs
    identical with and without speculation."""
    target, draft = long_context_pair
    out = tmp_path / "mixed"
    arguments = ["bench-mixed", "--target", str(target), "--draft", str(draft), "--out", str(out)]
    arguments += ["--chat-template", str(DEMO_CHAT_TEMPLATE), "--num-prompts", "3", "--max-new-tokens", "8"]
    finished = run_to_exit([*arguments, "--concurrency", "1", "--repeats", "1"], timeout_s=600)
    assert finished.returncode == 0, finished.stdout
    rows = json.loads((out / "latest.json").read_text())["rows"]
    assert [(row["concurrency"], row["class"], row["identical"]) for row in rows] == [
        (1, "free code", "1/1"),
        (1, "json schema", "1/1"),
        (1, "penalties", "1/1"),
    ]
    assert all(row["speculative_tok_s"] > 0 and row["target_only_tok_s"] > 0 for row in rows)
    assert "| 1 | json schema |" in (out / "latest.md").read_text()
