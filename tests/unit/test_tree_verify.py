"""Tree verification (tandem.sampling.tree_verify): the greedy walk on hand-built logits, and a chi-square test that
the sampled walk is lossless, built like tests/unit/test_sampling_lossless.py (target logits that depend on the
position only, so the first two committed tokens must follow p_0 x p_1 whatever the tree proposes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.tree_verify import TreeOutcome, verify_tree
from tandem.sampling.verify import target_probs
from tests.unit.test_sampling_lossless import (
    NUM_CONTROL_TRIALS,
    NUM_TRIALS,
    PARAMS,
    SIGNIFICANCE,
    TARGET_LOGITS,
    first_and_joint_p_values,
)

GREEDY = SamplingParams()
VOCAB = 10
# node:    0   1  2  3  4      root children 0, 1; node 0's children 2, 3; node 1's child 4
PARENTS = [-1, -1, 0, 0, 1]


def tree(tokens: Sequence[int], parents: Sequence[int] = PARENTS) -> DraftTree:
    return DraftTree(tuple(tokens), tuple(parents))


def logits_with_argmax(choices: Sequence[int]) -> torch.Tensor:  # -> [len(choices), VOCAB]
    rows = torch.zeros((len(choices), VOCAB))
    rows[torch.arange(len(choices)), torch.tensor(list(choices))] = 5.0
    return rows


def test_greedy_worked_example_of_the_docstring() -> None:
    tokens = [5, 6, 7, 8, 9]
    outcome = verify_tree(
        logits_with_argmax([6, 0, 9, 0, 0, 3]), tree(tokens, [-1, -1, 0, 1, 1]), GREEDY, torch.Generator()
    )
    assert outcome == TreeOutcome(accepted=2, tokens=[6, 9, 3], path=[1, 4])


@pytest.mark.parametrize(
    ("choices", "expected"),
    [
        # Root argmax matches no child: nothing accepted, the root's argmax is the correction.
        ([4, 0, 0, 0, 0, 0], TreeOutcome(0, [4], [])),
        # Root -> node 0 (token 1), node 0's argmax 3 is node 3's token; node 3 is a leaf: bonus from its row.
        ([1, 3, 0, 0, 7, 0], TreeOutcome(2, [1, 3, 7], [0, 3])),
        # Root -> node 1 (token 2), node 1's argmax 5 matches no child (node 4 holds 4): correction 5.
        ([2, 0, 5, 0, 0, 0], TreeOutcome(1, [2, 5], [1])),
    ],
)
def test_greedy_walks_the_matching_branch(choices: list[int], expected: TreeOutcome) -> None:
    tokens = [1, 2, 2, 3, 4]  # node 2 repeats node 1's token under another parent: the walk follows parents
    assert verify_tree(logits_with_argmax(choices), tree(tokens), GREEDY, torch.Generator()) == expected


def test_bad_trees_are_refused_naming_the_entry() -> None:
    with pytest.raises(ValueError, match=r"parents\[1\]: 1 must be -1"):
        verify_tree(logits_with_argmax([0, 0, 0]), tree([1, 2], [-1, 1]), GREEDY, torch.Generator())
    with pytest.raises(ValueError, match=r"target_logits must be \[num_drafts \+ 1, vocab\]"):
        verify_tree(logits_with_argmax([0, 0]), tree([1, 2], [-1, 0]), GREEDY, torch.Generator())


# Sampled trees. The rows of the target follow the depth: row 0 (root) is TARGET_LOGITS[start], node i's row is
# TARGET_LOGITS[start + depth(i)]; TARGET_LOGITS has rows for start 0..1 and depth 0..2.
LIKELY_TREE = [0, 2, 1, 3, 1]  # top-2 at the root (0, 2), likely children below
# Rare and impossible tokens (token 1 at position 1 has probability 0 under PARAMS' top_k) and a repeated sibling.
BAD_TREE = [3, 3, 1, 1, 2]


def tree_rows(start: int) -> torch.Tensor:  # -> [1 + len(PARENTS), vocab]
    depths = [0, *tree([0] * len(PARENTS)).depths()]
    return TARGET_LOGITS[[start + depth for depth in depths]]


def lossy_walk(
    target_logits: torch.Tensor, draft_tokens: Sequence[int], parents: Sequence[int], generator: torch.Generator
) -> TreeOutcome:
    """A wrong rule for the negative control: siblings tried with p(t) each, but the correction sampled from p itself
    (rejected mass not removed)."""
    probs = target_probs(target_logits, PARAMS)
    path: list[int] = []
    row = 0
    while True:
        children = [node for node, parent in enumerate(parents) if parent + 1 == row]
        chosen = next(
            (
                child
                for child in children
                if float(torch.rand(1, generator=generator)) < probs[row, draft_tokens[child]]
            ),
            None,
        )
        if chosen is None:
            token = int(torch.multinomial(probs[row], 1, generator=generator))
            return TreeOutcome(len(path), [*(draft_tokens[node] for node in path), token], path)
        path.append(chosen)
        row = chosen + 1


def first_two_tree_tokens(draft: Sequence[int], num_trials: int, seed: int, lossy: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    trials = []
    for _ in range(num_trials):
        committed: list[int] = []
        while len(committed) < 2:
            rows = tree_rows(len(committed))
            if lossy:
                outcome = lossy_walk(rows, draft, PARENTS, generator)
            else:
                outcome = verify_tree(rows, tree(draft), PARAMS, generator)
            committed.extend(outcome.tokens)
        trials.append(committed[:2])
    return torch.tensor(trials)


@pytest.mark.parametrize("draft", [LIKELY_TREE, BAD_TREE], ids=["likely-tree", "bad-tree"])
def test_sampled_tree_verification_follows_the_target_distribution(draft: list[int]) -> None:
    first_p_value, joint_p_value = first_and_joint_p_values(first_two_tree_tokens(draft, NUM_TRIALS, seed=3))
    assert first_p_value > SIGNIFICANCE
    assert joint_p_value > SIGNIFICANCE


def test_the_check_detects_a_tree_rule_that_keeps_rejected_mass() -> None:
    tokens = first_two_tree_tokens(LIKELY_TREE, NUM_CONTROL_TRIALS, seed=3, lossy=True)
    first_p_value, _ = first_and_joint_p_values(tokens)
    assert first_p_value < SIGNIFICANCE
