"""Gemma 4's assistant through `tandem serve`, for a multimodal checkpoint's text model: its rounds against
transformers' assisted generation (centroid head, the target at --tp 2), and everything a request may ask:
penalties, logit bias, min_tokens and a grammar, adaptive k, the Ray launcher (LM head), the prefix caches of the
target and of the replica, and a replica killed mid-stream (its requests move to the other replica, which needs
their K/V rows again: the target replays them). The tokens are always the target-only ones, and the assistant's
drafts are accepted."""

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
from transformers import Gemma4ForConditionalGeneration, PreTrainedModel
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from tests.helpers.gemma4_assistant_checkpoints import assisted_rounds, greedy_texts, write_fitted_assistant
from tests.helpers.gemma4_checkpoints import LONG_WINDOW, write_tiny_gemma4_multimodal
from tests.integration.stack import Stack, generate, serve
from tests.integration.test_families_served import MTP_PROMPTS, assert_served_rounds
from tests.integration.test_replicas import replica_pid

BLOCK = 16  # --block-size's default
PROMPTS = [*MTP_PROMPTS, [33, 91, 150, 6, 201, 48]]
LONG = [(7 * index + 11) % 300 + 10 for index in range(41)]  # two whole blocks and more


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multimodal Gemma 4 (its window longer than the sequences: round by round comparisons,
    tests.helpers.gemma4_assistant_checkpoints.assisted_rounds), and two assistants fitted to its texts: one with
    the LM head ("assistant"), one with the centroid head ("centroids")."""
    root = tmp_path_factory.mktemp("assistant-serving")
    write_tiny_gemma4_multimodal(root / "target", LONG_WINDOW)
    target = reference_target(root)
    texts = greedy_texts(target, [*MTP_PROMPTS, LONG], 30)
    write_fitted_assistant(root / "assistant", LONG_WINDOW, target, texts)
    write_fitted_assistant(root / "centroids", LONG_WINDOW, target, texts[:-1], centroids=True)
    return root


def reference_target(root: Path) -> PreTrainedModel:
    return Gemma4ForConditionalGeneration.from_pretrained(root / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def stack(checkpoints: Path) -> Iterator[Stack]:
    """The centroid head's two replicas for a target at --tp 2, at a fixed k of 3, drafting only when asked (rounds
    as transformers counts them)."""
    options = ("--draft-replicas", "2", "--speculative-num-steps", "3", "--draft-ahead", "0", "--tp", "2")
    with serve(checkpoints / "target", checkpoints / "centroids", *options, "--http-port", "0") as served:
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
    with (
        serve(checkpoints / "target", checkpoints / "assistant", "--adaptive-k", "--launcher", "ray") as stack,
        ThreadPoolExecutor(2) as pool,
    ):
        answers = list(pool.map(lambda ask: both(stack, **ask), asks))
    for ask, (speculative, alone) in zip(asks, answers, strict=True):
        assert speculative.token_ids == alone.token_ids, ask
    assert sum(speculative.stats.accepted_tokens for speculative, _ in answers) > 0


def test_rounds_equal_transformers_assisted_generation(stack: Stack, checkpoints: Path) -> None:
    """The kept K/V heads gathered from both ranks, drafted from by the centroid head."""
    target = reference_target(checkpoints)
    assistant = Gemma4AssistantForCausalLM.from_pretrained(checkpoints / "centroids", dtype=torch.float32).eval()
    texts = greedy_texts(target, MTP_PROMPTS, 30)
    expected = [assisted_rounds(target, assistant, prompt, 30, 3) for prompt in MTP_PROMPTS]
    assert_served_rounds(
        stack.address, expected, [text[len(prompt) :] for text, prompt in zip(texts, MTP_PROMPTS, strict=True)], 3
    )
    # Drafts accepted in some rounds; the centroid head's random clusters leave out some of the target's choices.
    assert max(count for rounds in expected for count in rounds.accepted) > 0


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
    prompts = [[*prompt, index] for index in range(2) for prompt in MTP_PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        expected = list(
            pool.map(
                lambda p: generate(stack.address, input_ids=p, max_new_tokens=60, disable_speculation=True), prompts
            )
        )
        futures = [pool.submit(generate, stack.address, input_ids=p, max_new_tokens=60) for p in prompts]
        os.kill(replica_pid(stack, "draft-1"), signal.SIGKILL)
        served = [future.result(timeout=300) for future in futures]
    assert [completion.token_ids for completion in served] == [completion.token_ids for completion in expected]
    assert any("draft replica draft-1 demoted" in line for line in stack.log)
    assert sum(completion.stats.accepted_tokens for completion in served) > 0
