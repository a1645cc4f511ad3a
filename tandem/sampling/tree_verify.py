"""Verification of a tree of draft tokens (tree drafting, EAGLE-2/3): which root-to-node path to keep, and the token
after it. The terms (accepted, correction, bonus, acceptance length) are tandem.sampling.verify's.

A tree of n drafts (tandem.sampling.draft_tree) is `tokens[i]` with `parents[i]`: -1 makes node i a child of the
last committed token (the root), otherwise parents[i] is an earlier node. The target scores the root and every node in
one pass (one tree mask), so `target_logits` has 1 + n rows: row 0 predicts the token after the root, row 1 + i the
token after node i. A node's children are tried in the order of their indices.

Greedy: start at the root; at each node take the child whose token equals the target's argmax at that node (the
node's own row); stop when no child matches. The argmax at the last accepted node is the correction (some children
were tried) or the bonus (a leaf). Worked example, parents [-1, -1, 0, 1, 1], tokens [5, 6, 7, 8, 9], row argmaxes
[6, 0, 9, 0, 0, 3] (rows 0..5): at the root the argmax 6 is node 1's token, so node 1 is accepted; at node 1 (row 2)
the argmax 9 is node 4's token, so node 4 is accepted; node 4 (row 5) is a leaf, and its argmax 3 is the bonus.
Tokens [6, 9, 3], accepted 2, path [1, 4].

Sampling, lossless (multi-draft recursive rejection sampling, SpecInfer / EAGLE, for a deterministic draft: its tokens
are argmax / top-k picks, so each sibling's q is one-hot): at a node with target distribution p, start with r = p;
for each child c in order, accept c with probability r(t_c) / sum(r); on rejection set r(t_c) = 0 (renormalising is
implicit in dividing by sum(r)); if every child is rejected, the correction is sampled from norm(r). Each committed
token is distributed as p: with children tokens t_1, t_2 (distinct), P(t_1) = p(t_1); P(t_2) = (1 - p(t_1)) *
p(t_2) / (1 - p(t_1)) = p(t_2); any other token x comes from the residual with probability (1 - p(t_1) - p(t_2)) *
p(x) / (1 - p(t_1) - p(t_2)) = p(x). Worked example: p = [0.5, 0.3, 0.2] and children with tokens 1 then 0: token 1
is accepted with probability 0.3; on rejection r = [0.5, 0, 0.2] and token 0 is accepted with probability 0.5 / 0.7;
on rejection the correction is token 2 with probability 1. A sibling repeating a rejected token has r(t) = 0 and is
always rejected. An accepted child's own children are then tried against the target's row of that child.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling.draft_tree import DraftTree, check_parents
from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import seeded_scores, target_probs


@dataclass(frozen=True)
class TreeOutcome:
    accepted: int  # number of draft tokens accepted, the path's length
    tokens: list[int]  # the path's tokens, then one correction or bonus token; len == accepted + 1
    path: list[int]  # the accepted nodes from the root down, increasing indices


def verify_tree(
    target_logits: torch.Tensor,  # [1 + n, vocab]
    tree: DraftTree,  # n nodes
    params: SamplingParams,
    generator: torch.Generator,  # CPU, from make_generator; greedy draws nothing
    position: int | None = None,  # the sequence position of the token row 0 decides; None: no seeded rule
) -> TreeOutcome:
    """The greedy walk or the lossless sampled walk of the module docstring; for a seed (and `position`), the greedy
    walk over the seeded scores (tandem.sampling.verify), each row keyed by its node's depth."""
    check_parents(tree.parents, len(tree))
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree) + 1:
        raise ValueError(
            f"target_logits must be [num_drafts + 1, vocab] with num_drafts = {len(tree)}, "
            f"got {list(target_logits.shape)}"
        )
    children = tree.children()
    if params.is_greedy:
        return _walk_greedy(target_logits.argmax(dim=-1).tolist(), tree.tokens, children)
    if params.seed is not None and position is not None:
        depths = [0]
        for parent in tree.parents:  # a parent comes before its children: depth of row 1 + i
            depths.append(1 + (0 if parent < 0 else depths[parent + 1]))
        scores = seeded_scores(target_logits, params, [position + depth for depth in depths])
        return _walk_greedy(scores.argmax(dim=-1).tolist(), tree.tokens, children)
    return _walk_sampled(target_probs(target_logits.cpu(), params), tree.tokens, children, generator)


def _walk_greedy(choices: list[int], draft_tokens: Sequence[int], children: list[list[int]]) -> TreeOutcome:
    path: list[int] = []
    row = 0  # the current node's row: 0 for the root, 1 + i for node i
    while True:
        matched = next((child for child in children[row] if draft_tokens[child] == choices[row]), None)
        if matched is None:
            break
        path.append(matched)
        row = matched + 1
    return TreeOutcome(len(path), [*(int(draft_tokens[node]) for node in path), int(choices[row])], path)


def _walk_sampled(
    probs: torch.Tensor,  # [1 + n, vocab]
    draft_tokens: Sequence[int],
    children: list[list[int]],
    generator: torch.Generator,
) -> TreeOutcome:
    path: list[int] = []
    row = 0
    while True:
        residual = probs[row].clone()  # r, starts as p at the current node
        accepted_child = None
        for child in children[row]:
            token = int(draft_tokens[child])
            total = float(residual.sum())
            uniform = float(torch.rand(1, generator=generator))
            if total > 0.0 and uniform * total < float(residual[token]):
                accepted_child = child
                break
            residual[token] = 0.0
        if accepted_child is None:
            if float(residual.sum()) <= 0.0:
                # Every token of p was a rejected child: each had r(t) / sum(r) = 1 at its turn, so this is float
                # rounding only, and p is the distribution to fall back to.
                residual = probs[row]
            token = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
            return TreeOutcome(len(path), [*(int(draft_tokens[node]) for node in path), token], path)
        path.append(accepted_child)
        row = accepted_child + 1
