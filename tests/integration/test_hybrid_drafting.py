"""`--hybrid-ngram` through a real `tandem serve`: the n-gram branch merged into a draft model's chains and trees.

Greedy output equals target-only on the same stack, with the trained demo head (chain and tree) and with a tiny random
head whose own drafts are rarely right, so that what it accepts comes from the merged branches; per-request stats
count acceptance per depth; a seeded sampled request repeats itself; a stack without a draft model is refused.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.settings import DEMO_DRAFT, DEMO_TARGET
from tandem.wire import orchestrator_pb2
from tests.integration.stack import DEMO_HTTP, TREE, SharedStacks, generate, run_to_exit, serve

STEPS = 3
CHAIN = ["--hybrid-ngram", "--speculative-num-steps", str(STEPS)]
HYBRID_TREE = ["--hybrid-ngram", *TREE]  # test_structured_kinds' "hybrid tree": one shared stack
DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\nimport re\nimport json\n",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
]
# Token ids for the tiny target: phrases that repeat, so the lookup has something to propose.
PHRASE = [11, 57, 93, 140, 22, 7, 301, 88]
TINY_PROMPTS = [[1, *PHRASE, 5, *PHRASE, 5, *PHRASE[:3]], [1, 42, 42, 99, 42, 42, 99, 42], [1, *PHRASE[::-1] * 3]]
NEW_TOKENS = 32

Result = tuple[list[int], orchestrator_pb2.GenerateStats]


def run_concurrently(address: str, prompts: list[dict[str, object]], disable_speculation: bool) -> list[Result]:
    def one(prompt: dict[str, object]) -> Result:
        completion = generate(
            address, max_new_tokens=NEW_TOKENS, ignore_eos=True, disable_speculation=disable_speculation, **prompt
        )
        assert len(completion.token_ids) == NEW_TOKENS
        return completion.token_ids, completion.stats

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def per_round(results: list[Result], field: str) -> float:
    """A statistic summed over the requests, per verification round."""
    return sum(getattr(stats, field) for _, stats in results) / sum(stats.rounds for _, stats in results)


def check_stats_by_depth(results: list[Result]) -> None:
    """Acceptance per depth: at most the steps deep, summing to the accepted drafts, never deeper than shallower."""
    for _, stats in results:
        depths = list(stats.accepted_per_position)
        assert len(depths) <= STEPS
        assert sum(depths) == stats.accepted_tokens
        assert depths == sorted(depths, reverse=True)
        # The prompt's last chunk gives the first token; each round 1 + its accepted drafts.
        assert stats.rounds + stats.accepted_tokens == NEW_TOKENS - 1


@pytest.mark.parametrize("shape", [CHAIN, HYBRID_TREE], ids=["chain", "tree"])
def test_hybrid_on_the_demo_pair_matches_target_only(shape: list[str], stacks: SharedStacks) -> None:
    prompts: list[dict[str, object]] = [{"prompt": prompt} for prompt in DEMO_PROMPTS]
    stack = stacks.get(DEMO_TARGET, DEMO_DRAFT, *shape, *DEMO_HTTP)
    hybrid = run_concurrently(stack.address, prompts, disable_speculation=False)
    target_only = run_concurrently(stack.address, prompts, disable_speculation=True)
    assert [tokens for tokens, _ in hybrid] == [tokens for tokens, _ in target_only]
    assert sum(stats.accepted_tokens for _, stats in hybrid) > 0
    check_stats_by_depth(hybrid)


def test_hybrid_branches_are_accepted_beside_a_random_head(llama_target: Path, random_draft: Path) -> None:
    prompts: list[dict[str, object]] = [{"input_ids": ids} for ids in TINY_PROMPTS]
    shape = [
        "--speculative-num-steps",
        str(STEPS),
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "4",
    ]
    with serve(llama_target, random_draft, *shape, "--hybrid-ngram", "--ngram-min", "1") as stack:
        hybrid = run_concurrently(stack.address, prompts, disable_speculation=False)
        target_only = run_concurrently(stack.address, prompts, disable_speculation=True)
        sampled = [
            generate(stack.address, input_ids=TINY_PROMPTS[0], max_new_tokens=16, temperature=1.0, seed=3)
            for _ in range(2)
        ]
        assert "with n-gram drafts merged in" in next(line for line in stack.log if "tandem ready" in line)
    with serve(llama_target, random_draft, *shape) as stack:  # the same head and shape, without the lookup
        alone = run_concurrently(stack.address, prompts, disable_speculation=False)
    assert [tokens for tokens, _ in hybrid] == [tokens for tokens, _ in target_only] == [t for t, _ in alone]
    check_stats_by_depth(hybrid)
    # The head's trees hold 3 nodes, merged ones more; the lookup's branches are what gets accepted, in fewer rounds.
    assert per_round(hybrid, "draft_tokens") > per_round(alone, "draft_tokens")
    assert per_round(hybrid, "accepted_tokens") > per_round(alone, "accepted_tokens")
    assert sampled[0].token_ids == sampled[1].token_ids and len(sampled[0].token_ids) == 16
    assert sampled[0].stats.draft_tokens > 0


def test_hybrid_without_a_draft_model_is_refused(llama_target: Path) -> None:
    result = run_to_exit(["serve", "--target", str(llama_target), "--hybrid-ngram", "--port", "0"])
    assert result.returncode != 0
    assert "--hybrid-ngram merges n-gram drafts into a draft model's: give --draft DIR" in result.stdout
    result = run_to_exit(["serve", "--target", str(llama_target), "--draft", "ngram", "--hybrid-ngram"])
    assert result.returncode != 0
    assert "--draft ngram has none" in result.stdout
