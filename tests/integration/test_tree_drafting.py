"""Tree drafting through a real `tandem serve` (--speculative-eagle-topk 4 --speculative-num-draft-tokens 8
--speculative-num-steps 3): greedy output equals target-only on the same stack, with the trained demo head and with a
tiny random head; on the demo pair the tree's mean acceptance length is at least the chain's on the same prompts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tandem.settings import DEMO_DRAFT, DEMO_TARGET
from tandem.wire import orchestrator_pb2
from tests.integration.stack import DEMO_HTTP, TREE, SharedStacks, generate, serve

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, item):",
    "for i in range(10):",
]
MAX_NEW_TOKENS = 32
CHAIN = ("--speculative-num-steps", "3")


def run_concurrently(address: str, disable_speculation: bool) -> list[tuple[list[int], orchestrator_pb2.GenerateStats]]:
    def one(prompt: str) -> tuple[list[int], orchestrator_pb2.GenerateStats]:
        completion = generate(
            address,
            prompt=prompt,
            max_new_tokens=MAX_NEW_TOKENS,
            ignore_eos=True,
            disable_speculation=disable_speculation,
        )
        assert len(completion.token_ids) == MAX_NEW_TOKENS
        return completion.token_ids, completion.stats

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def mean_acceptance_length(results: list[tuple[list[int], orchestrator_pb2.GenerateStats]]) -> float:
    """1 + accepted drafts per verification round, over all requests."""
    rounds = sum(stats.rounds for _, stats in results)
    accepted = sum(stats.accepted_tokens for _, stats in results)
    return 1 + accepted / rounds


def test_tree_on_the_demo_pair_matches_target_only_and_accepts_at_least_the_chain(stacks: SharedStacks) -> None:
    stack = stacks.get(DEMO_TARGET, DEMO_DRAFT, *TREE, *DEMO_HTTP)
    tree = run_concurrently(stack.address, disable_speculation=False)
    target_only = run_concurrently(stack.address, disable_speculation=True)
    assert [tokens for tokens, _ in tree] == [tokens for tokens, _ in target_only]
    # Trees of 7 drafts were verified; acceptance is counted per depth (accepted_per_position), at most the 3 steps.
    for _, stats in tree:
        assert stats.draft_tokens > 0
        assert len(stats.accepted_per_position) <= 3
        assert sum(stats.accepted_per_position) == stats.accepted_tokens
        depths = list(stats.accepted_per_position)
        assert depths == sorted(depths, reverse=True)  # a path accepted to depth d was accepted at every depth above
    chain = run_concurrently(stacks.get(DEMO_TARGET, DEMO_DRAFT, *CHAIN, *DEMO_HTTP).address, disable_speculation=False)
    assert [tokens for tokens, _ in chain] == [tokens for tokens, _ in target_only]
    tree_length, chain_length = mean_acceptance_length(tree), mean_acceptance_length(chain)
    print(f"mean acceptance length on the demo pair: tree {tree_length:.3f}, chain {chain_length:.3f}")
    assert tree_length >= chain_length


def test_tree_with_a_random_head_matches_target_only(llama_target: Path, random_draft: Path) -> None:
    with serve(llama_target, random_draft, *TREE) as stack:
        tree = run_concurrently(stack.address, disable_speculation=False)
        target_only = run_concurrently(stack.address, disable_speculation=True)
        # Sampling verifies trees by the lossless walk (the chi-square tests are unit tests); a seed repeats it.
        sampled = [
            generate(stack.address, prompt=PROMPTS[0], max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=3)
            for _ in range(2)
        ]
    assert [tokens for tokens, _ in tree] == [tokens for tokens, _ in target_only]
    assert all(stats.draft_tokens >= stats.rounds for _, stats in tree)
    assert len(sampled[0].token_ids) == 16
    assert sampled[0].token_ids == sampled[1].token_ids
    assert sampled[0].stats.draft_tokens > 0
