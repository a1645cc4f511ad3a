"""Greedy speculative output == target-only output == transformers generate, through the real stack."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import SharedStacks, draft_info, generate, serve, service_addresses, target_info

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, item):",
    "The quick brown fox",
]
MAX_NEW_TOKENS = 24


def reference_greedy(target: Path, prompt: str, max_new_tokens: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None  # the requests below set ignore_eos
    with torch.no_grad():
        output = model.generate(
            input_ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, attention_mask=None
        )
    return [int(t) for t in output[0, input_ids.shape[1] :]]


def run_concurrently(address: str, disable_speculation: bool) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        completion = generate(
            address,
            prompt=prompt,
            max_new_tokens=MAX_NEW_TOKENS,
            ignore_eos=True,
            disable_speculation=disable_speculation,
        )
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == MAX_NEW_TOKENS
        return completion.token_ids

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_random_draft_matches_target_only_and_transformers(
    llama_target: Path, random_draft: Path, stacks: SharedStacks
) -> None:
    expected = [reference_greedy(llama_target, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    stack = stacks.get(llama_target, random_draft, "--speculative-num-steps", "4")
    speculative = run_concurrently(stack.address, disable_speculation=False)
    target_only = run_concurrently(stack.address, disable_speculation=True)
    # Alone and without drafts, a request decodes 4 tokens per target step (--num-scheduler-steps): the first
    # token comes with the prefill, the other 23 in 6 steps.
    alone = generate(
        stack.address, prompt=PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, disable_speculation=True
    )
    assert alone.token_ids == expected[0]
    assert alone.stats.rounds == 6, alone.stats
    # Output-of-layer ids [1, 3, 5] (first id 1) resolve to capture indices [2, 4, 6].
    assert list(draft_info(service_addresses(stack.log)["draft"]).capture_indices) == [2, 4, 6]
    assert target_only == expected
    assert speculative == expected


@pytest.mark.parametrize(
    ("layer_ids", "convention", "expected_indices"),
    [
        ((2, 3, 4), "auto", [2, 3, 4]),  # first id 2: input-to-layer ids, used as they are
        ((1, 3, 5), "input", [1, 3, 5]),  # explicit override of the auto rule
    ],
)
def test_layer_id_conventions_on_qwen2(
    tmp_path: Path, layer_ids: tuple[int, ...], convention: str, expected_indices: list[int]
) -> None:
    target = write_tiny_target(
        tmp_path / "qwen2", TinyTargetSpec(family="qwen2", num_layers=6, tie_word_embeddings=True)
    )
    draft = write_tiny_eagle3(tmp_path / "draft", target, TinyEagle3Spec(layer_ids=layer_ids, seed=3))
    expected = [reference_greedy(target, prompt, 12) for prompt in PROMPTS[:2]]
    with serve(target, draft, "--aux-layer-convention", convention, "--speculative-num-steps", "3") as stack:
        outputs = [
            generate(stack.address, prompt=prompt, max_new_tokens=12, ignore_eos=True).token_ids
            for prompt in PROMPTS[:2]
        ]
        assert list(draft_info(service_addresses(stack.log)["draft"]).capture_indices) == expected_indices
        assert any(f"capture indices {expected_indices}" in line for line in stack.log)
    assert outputs == expected


@pytest.fixture(scope="module")
def odd_vocabulary_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    """A Qwen2 target whose vocabulary (333) is not a multiple of 64, an EAGLE3 head without an embedding (it pulls
    the target's as vocab-parallel shards over GetWeights), and transformers' greedy outputs for PROMPTS."""
    target = write_tiny_target(
        tmp_path_factory.mktemp("qwen2-333"), TinyTargetSpec(family="qwen2", vocab_size=333, num_layers=4)
    )
    draft = write_tiny_eagle3(tmp_path_factory.mktemp("draft-333"), target, TinyEagle3Spec(layer_ids=(1, 2, 3)))
    return target, draft, [reference_greedy(target, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_target_matches_transformers(
    odd_vocabulary_pair: tuple[Path, Path, list[list[int]]], tp: int
) -> None:
    """tp 1 and tp 2 give transformers' greedy outputs, so the same outputs, target-only and speculative."""
    target, draft, expected = odd_vocabulary_pair
    with serve(target, draft, "--tp", str(tp), "--speculative-num-steps", "3") as stack:
        target_only = run_concurrently(stack.address, disable_speculation=True)
        speculative = run_concurrently(stack.address, disable_speculation=False)
        assert target_info(service_addresses(stack.log)["target"]).tp_size == tp
    assert target_only == expected
    assert speculative == expected
    # The launcher stopped the target with SIGTERM; rank 0 then stopped its other ranks, which said so (the output
    # pump may still be reading their last lines).
    for rank in range(1, tp):
        deadline = time.monotonic() + 10.0
        while not any(f"rank {rank}/{tp}: stopped by rank 0" in line for line in stack.log):
            assert time.monotonic() < deadline, "".join(stack.log)
            time.sleep(0.1)
