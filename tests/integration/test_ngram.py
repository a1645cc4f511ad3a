"""`tandem serve --draft ngram` on the tiny target: prompt-lookup drafts from the orchestrator, no draft process.

Greedy output equals target-only output token for token, drafts taken from the request's own tokens get accepted
(the prompts repeat themselves, and so does a tiny random model's greedy output), the target streams no hidden rows
for them, and every KV block comes back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.wire import target_pb2
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.integration.stack import Stack, generate, run_to_exit, serve, service_addresses, target_info

NEW_TOKENS = 48
PHRASE = [11, 57, 93, 140, 22, 7, 301, 88]
PROMPTS = [[1, *PHRASE, 5, *PHRASE, 5, *PHRASE[:3]], [1, 42, 42, 99, 42, 42, 99, 42], [1, *PHRASE[::-1] * 3]]


@pytest.fixture(scope="module")
def stack(llama_target: Path) -> Iterator[Stack]:
    with serve(llama_target, None, "--draft", "ngram", "--speculative-num-steps", "4") as running:
        yield running


def idle_target(address: str) -> target_pb2.TargetInfo:
    """The target's info once it holds no request (a request is released just after its last message)."""
    deadline = time.monotonic() + 30
    while (info := target_info(address)).running_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    return info


def test_ngram_drafts_are_accepted_and_greedy_output_equals_target_only(stack: Stack) -> None:
    expected = [
        generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True, disable_speculation=True)
        for p in PROMPTS
    ]
    completions = [generate(stack.address, input_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    assert [c.token_ids for c in completions] == [e.token_ids for e in expected]
    assert all(len(c.token_ids) == NEW_TOKENS for c in completions)
    assert all(e.stats.draft_tokens == 0 for e in expected)
    accepted = sum(c.stats.accepted_tokens for c in completions)
    assert accepted > 0, [c.stats for c in completions]
    for completion in completions:
        stats = completion.stats
        assert stats.draft_tokens >= stats.accepted_tokens
        assert len(stats.accepted_per_position) <= 4
        assert sum(stats.accepted_per_position) == stats.accepted_tokens
        # The prompt's last chunk gives the first token; each round 1 + its accepted drafts.
        assert stats.rounds + stats.accepted_tokens == NEW_TOKENS - 1
    info = idle_target(service_addresses(stack.log)["target"])
    assert (info.running_requests, info.kv_blocks_free) == (0, info.kv_blocks_total)


def test_no_draft_process_runs_and_the_target_streams_nothing(stack: Stack) -> None:
    ready = next(line for line in stack.log if "tandem ready" in line)
    assert "n-gram drafts in the orchestrator, 2 processes" in ready
    assert set(service_addresses(stack.log)) == {"target", "orchestrator"}
    log = "".join(stack.log)
    assert "subscribed" not in log  # neither a draft's hidden-state stream nor a replica the target does not know
    assert "demoted" not in log


def test_orchestrator_refuses_ngram_beside_draft_replicas(llama_target: Path) -> None:
    result = run_to_exit(
        [
            "orchestrator",
            "--target-address", "127.0.0.1:1",
            "--tokenizer", str(llama_target),
            "--draft", "ngram",
            "--draft-address", "127.0.0.1:2",
            "--port", "0",
        ]
    )  # fmt: skip
    assert result.returncode == 2, result.stdout
    assert "--draft ngram drafts in the orchestrator and takes no draft replicas" in result.stdout


def test_bench_draft_ngram_measures_split_and_colocated_with_target_only_outputs(tmp_path: Path) -> None:
    # The held-out prompts are source files: the tiny tokenizer makes hundreds of tokens of them.
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec(max_position_embeddings=4096))
    out = tmp_path / "results"
    arguments = ["bench", "--target", str(target), "--draft", "ngram", "--ngram-max", "3", "--out", str(out)]
    arguments += ["--no-transformers", "--num-prompts", "2", "--max-new-tokens", "8", "--concurrency", "1"]
    finished = run_to_exit(arguments, timeout_s=600)
    assert finished.returncode == 0, finished.stdout

    document = json.loads((out / "latest.json").read_text())
    assert document["settings"]["ngram"] == {"max_n": 3, "min_n": 1}
    assert document["settings"]["draft_dir"] is None
    rows = {row["setup"]: row for row in document["summary"]}
    assert set(rows) == {"split", "colocated"}
    for row in rows.values():
        assert row["identical_outputs"] == "2/2"
        assert row["mean_acceptance_length"] >= 1.0
    assert "n-gram drafts (suffixes of 3 down to 1 tokens)" in (out / "latest.md").read_text()
