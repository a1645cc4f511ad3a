"""Gemma 4's assistant through `tandem serve` with everything a request may ask: penalties, logit bias, min_tokens
and a grammar, adaptive k, the Ray launcher, the prefix caches of the target and of the replica, and a replica
killed mid-stream (its requests move to the other replica, which needs their K/V rows again: the target replays
them). The tokens are always the target-only ones, and the assistant's drafts are accepted."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import Gemma4ForCausalLM
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from tests.helpers.gemma4_assistant_checkpoints import assisted_rounds, greedy_texts, write_fitted_assistant
from tests.helpers.gemma4_checkpoints import LONG_WINDOW, write_tiny_gemma4
from tests.integration.stack import Stack, generate, serve
from tests.integration.test_families_served import MTP_PROMPTS, assert_served_rounds
from tests.integration.test_replicas import replica_pid

BLOCK = 16  # --block-size's default
PROMPTS = [*MTP_PROMPTS, [33, 91, 150, 6, 201, 48]]
LONG = [(7 * index + 11) % 300 + 10 for index in range(41)]  # two whole blocks and more


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("assistant-serving")
    spec = LONG_WINDOW  # round by round comparisons (tests.helpers.gemma4_assistant_checkpoints.assisted_rounds)
    write_tiny_gemma4(root / "target", spec)
    target = Gemma4ForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    write_fitted_assistant(root / "assistant", spec, target, greedy_texts(target, [*PROMPTS[:2], LONG], 30))
    return root


@pytest.fixture(scope="module")
def stack(checkpoints: Path) -> Iterator[Stack]:
    """Two replicas at a fixed k of 3, drafting only when asked (rounds as transformers counts them)."""
    options = ("--draft-replicas", "2", "--speculative-num-steps", "3", "--draft-ahead", "0", "--http-port", "0")
    with serve(checkpoints / "target", checkpoints / "assistant", *options) as served:
        yield served


def both(stack: Stack, **options: Any) -> tuple[Any, Any]:
    """The completion with speculation, and the one without."""
    speculative = generate(stack.address, max_new_tokens=30, **options)
    return speculative, generate(stack.address, max_new_tokens=30, disable_speculation=True, **options)


def test_request_options_and_a_grammar_keep_the_target_only_tokens(checkpoints: Path) -> None:
    """With adaptive k (rounds of k = 0 join their rows to the next round the replica is asked about), and the
    services started as Ray actors."""
    asks: list[dict[str, Any]] = [
        {"input_ids": PROMPTS[0], "ignore_eos": True},
        {"input_ids": PROMPTS[1], "ignore_eos": True, "frequency_penalty": 0.6, "presence_penalty": 0.4},
        {"input_ids": PROMPTS[1], "ignore_eos": True, "repetition_penalty": 1.3, "logit_bias": {61: 5.0, 77: -5.0}},
        {"input_ids": PROMPTS[2], "min_tokens": 20},
        {"input_ids": PROMPTS[0], "regex": "[a-f]{4}( [0-9]{2,3}){3}"},
    ]
    accepted = 0
    with serve(checkpoints / "target", checkpoints / "assistant", "--adaptive-k", "--launcher", "ray") as stack:
        for ask in asks:
            speculative, alone = both(stack, **ask)
            assert speculative.token_ids == alone.token_ids, ask
            accepted += speculative.stats.accepted_tokens
    assert accepted > 0


def test_rounds_equal_transformers_assisted_generation(stack: Stack, checkpoints: Path) -> None:
    target = Gemma4ForCausalLM.from_pretrained(checkpoints / "target", dtype=torch.float32).eval()
    assistant = Gemma4AssistantForCausalLM.from_pretrained(checkpoints / "assistant", dtype=torch.float32).eval()
    texts = greedy_texts(target, MTP_PROMPTS, 30)
    expected = [assisted_rounds(target, assistant, prompt, 30, 3) for prompt in MTP_PROMPTS]
    assert_served_rounds(stack.address, expected, texts, 3)
    accepted = [count for rounds in expected for count in rounds.accepted]
    assert min(accepted) < 2 <= max(accepted)  # drafts accepted in some rounds, two in a row in some


def draft_prefix_counts(stack: Stack) -> tuple[float, float]:
    """The replicas' prefix cache queries and hits so far (the orchestrator's /metrics sums every replica's)."""
    with urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {"tandem:draft_prefix_cache_queries_total": 0.0, "tandem:draft_prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals["tandem:draft_prefix_cache_queries_total"], totals["tandem:draft_prefix_cache_hits_total"]


def test_a_repeated_prompt_is_taken_from_both_caches(stack: Stack) -> None:
    before = draft_prefix_counts(stack)
    first = generate(stack.address, input_ids=LONG, max_new_tokens=24, ignore_eos=True)
    again = generate(stack.address, input_ids=LONG, max_new_tokens=24, ignore_eos=True)
    after = draft_prefix_counts(stack)
    # A row's K/V depends on the tokens up to its own position: every whole block found is reused, on both sides.
    whole_blocks = (len(LONG) - 1) // BLOCK * BLOCK
    assert (first.stats.cached_tokens, again.stats.cached_tokens) == (0, whole_blocks)
    assert (after[0] - before[0], after[1] - before[1]) == (whole_blocks, whole_blocks)
    assert again.token_ids == first.token_ids


def test_a_killed_replica_moves_its_requests_and_their_rows_are_replayed(stack: Stack) -> None:
    prompts = [[*prompt, index] for index in range(2) for prompt in PROMPTS]
    expected = [generate(stack.address, input_ids=p, max_new_tokens=80, disable_speculation=True) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, stack.address, input_ids=p, max_new_tokens=80) for p in prompts]
        os.kill(replica_pid(stack, "draft-1"), signal.SIGKILL)
        served = [future.result(timeout=300) for future in futures]
    assert [completion.token_ids for completion in served] == [completion.token_ids for completion in expected]
    assert any("draft replica draft-1 demoted" in line for line in stack.log)
    assert sum(completion.stats.accepted_tokens for completion in served) > 0
