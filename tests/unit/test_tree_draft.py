"""Tree expansion of an EAGLE3 draft (draft_server.tree_draft): frontier and selection on hand-built scores, and the
runner's tree on a tiny random head against a naive expansion that runs every branch as a chain on a fresh cache."""

from __future__ import annotations

import pytest
import torch

from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from draft_server.tree_draft import as_tree, best_children, propose_trees, select_tree
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.eagle3 import Eagle3Draft, load_eagle3
from tandem.sampling.draft_tree import DraftTree
from tandem.settings import KVCacheSettings, TreeShape
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla
from tests.helpers.target_rows import random_rows
from tests.unit.test_runners import BLOCK_SIZE

CACHE = KVCacheSettings(num_blocks=64, block_size=BLOCK_SIZE)


def test_worked_example_of_the_docstring() -> None:
    # Step 0: a (-0.1), b (-0.5). Step 1: a's children a1 (-0.2 more), a2; b's children b1, b2.
    frontier = best_children([-0.1, -0.5], [[-0.2, -1.9], [-0.4, -0.2]], [[11, 12], [21, 22]], topk=2)
    assert [(round(score, 6), slot, token) for score, slot, token in frontier] == [(-0.3, 0, 11), (-0.7, 1, 22)]
    # Nodes in creation order: a, b, a1, b2.
    scores, parents = [-0.1, -0.5, -0.3, -0.7], [-1, -1, 0, 1]
    kept = select_tree(scores, parents, 3)
    assert kept == [0, 1, 2]
    assert as_tree(kept, parents) == [-1, -1, 0]


def test_frontier_takes_the_best_of_k_by_k_children_not_the_best_per_parent() -> None:
    # Parent 0 is so much better that both of its children beat parent 1's best child.
    frontier = best_children([-0.1, -3.0], [[-0.5, -0.6], [-0.01, -0.02]], [[1, 2], [3, 4]], topk=2)
    assert [(slot, token) for _, slot, token in frontier] == [(0, 1), (0, 2)]


def test_selection_keeps_parents_and_counts_nodes() -> None:
    # A deep chain of near-certain children outranks a weak sibling at the root: the tree follows it.
    scores = [-0.1, -2.0, -0.1 - 1e-3, -0.1 - 2e-3, -2.5]
    parents = [-1, -1, 0, 2, 1]
    kept = select_tree(scores, parents, 3)
    assert kept == [0, 2, 3]
    assert as_tree(kept, parents) == [-1, 0, 1]
    # Ties rank the earlier node (the parent) first, so a child equal to its parent (p == 1) keeps the parent.
    assert select_tree([-1.0, -1.0, -1.0], [-1, 0, 1], 2) == [0, 1]
    # Scores that break the rule (a child above its parent) are refused rather than giving an open tree.
    with pytest.raises(ValueError, match="node 1 kept without its parent 0"):
        select_tree([-5.0, -0.1], [-1, 0], 1)


@pytest.fixture(scope="module", params=["llama-layer", "mla"])
def draft(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Eagle3Draft:
    target_dir = write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "mla":
        written = write_tiny_eagle3_mla(directory, target_dir, TinyEagle3MLASpec())
    else:
        spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
        written = write_tiny_eagle3(directory, target_dir, spec)
    model, _ = load_eagle3(written)
    return model


def branch_log_probs(model: Eagle3Draft, rows: TargetRows, branch: list[int]) -> torch.Tensor:
    """The draft's log probabilities (draft vocabulary) after the ingested rows and `branch` (target ids), run as a
    chain on a fresh cache with direct model calls."""
    cache = PagedKVCache.for_layout(1, model.config.cache_layout, CACHE, torch.float32, torch.device("cpu"))
    sequence = SequenceKV()
    with torch.no_grad():
        step = model(
            torch.tensor(list(rows.next_tokens)),
            model.project_features(rows.features),
            cache.plan([(sequence, len(rows.next_tokens))]),
            cache,
        )
        for token in branch:
            step = model(torch.tensor([token]), step.hidden[-1:], cache.plan([(sequence, 1)]), cache)
    return torch.log_softmax(step.logits[-1].float(), dim=-1)


def naive_tree(model: Eagle3Draft, rows: TargetRows, topk: int, num_steps: int, count: int) -> DraftTree:
    """The expansion rule run branch by branch: every frontier node's branch from scratch."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    branches: dict[int, list[int]] = {}

    def add(token: int, parent: int, score: float) -> int:
        tokens.append(token)
        parents.append(parent)
        scores.append(score)
        branches[len(tokens) - 1] = [*(branches[parent] if parent >= 0 else []), token]
        return len(tokens) - 1

    best, ids = branch_log_probs(model, rows, []).topk(topk)
    frontier = [add(int(t), -1, float(s)) for s, t in zip(best, model.to_target_ids(ids), strict=True)]
    for _ in range(1, num_steps):
        child_log_probs, child_tokens = [], []
        for node in frontier:
            best, ids = branch_log_probs(model, rows, branches[node]).topk(topk)
            child_log_probs.append(best.tolist())
            child_tokens.append(model.to_target_ids(ids).tolist())
        chosen = best_children([scores[node] for node in frontier], child_log_probs, child_tokens, topk)
        frontier = [add(token, frontier[slot], score) for score, slot, token in chosen]
    kept = select_tree(scores, parents, count)
    return DraftTree(tuple(tokens[node] for node in kept), tuple(as_tree(kept, parents)))


@pytest.mark.parametrize(("topk", "num_steps", "num_draft_tokens"), [(2, 3, 5), (4, 3, 8), (3, 4, 11)])
def test_runner_tree_equals_the_naive_expansion(
    draft: Eagle3Draft, topk: int, num_steps: int, num_draft_tokens: int
) -> None:
    runner = DraftRunner(draft, CACHE)
    first = random_rows(0, 9, seed=1)
    (tree,) = propose_trees(runner, [ProposeInput("a", first, num_steps)], topk, num_draft_tokens)
    assert len(tree.tokens) == num_draft_tokens - 1
    assert all(-1 <= parent < index for index, parent in enumerate(tree.parents))
    assert tree == naive_tree(draft, first, topk, num_steps, num_draft_tokens - 1)
    assert len({(parent, token) for parent, token in zip(tree.parents, tree.tokens, strict=True)}) == len(tree.tokens)
    # The next round truncates the speculative rows: its tree equals a fresh runner's on the same rows.
    second = random_rows(9, 2, seed=2)
    (again,) = propose_trees(runner, [ProposeInput("a", second, num_steps)], topk, num_draft_tokens)
    both = TargetRows(0, [*first.next_tokens, *second.next_tokens], torch.cat([first.features, second.features]))
    assert again == naive_tree(draft, both, topk, num_steps, num_draft_tokens - 1)


def test_topk_one_is_the_chain(draft: Eagle3Draft) -> None:
    rows = random_rows(0, 9, seed=3)
    (tree,) = propose_trees(DraftRunner(draft, CACHE), [ProposeInput("a", rows, 4)], topk=1, num_draft_tokens=5)
    assert [list(tree.tokens)] == DraftRunner(draft, CACHE).propose([ProposeInput("a", rows, 4)])
    assert tree.parents == (-1, 0, 1, 2) and tree.is_chain


def test_batched_requests_expand_independently(draft: Eagle3Draft) -> None:
    rows_a, rows_b = random_rows(0, 9, seed=4), random_rows(0, 6, seed=5)
    inputs = [ProposeInput("a", rows_a, 3), ProposeInput("b", rows_b, 2)]
    trees = propose_trees(DraftRunner(draft, CACHE), inputs, topk=3, num_draft_tokens=6)
    assert trees == [naive_tree(draft, rows_a, 3, 3, 5), naive_tree(draft, rows_b, 3, 2, 5)]


def test_proposals_leave_no_autograd_history_in_the_cache(draft: Eagle3Draft) -> None:
    # The head's parameters require grad, as loaded. A proposal outside inference mode made the cache's in-place
    # writes part of autograd's graph, which then kept every step of every request alive (memory grew each round).
    assert any(parameter.requires_grad for parameter in draft.parameters())
    runner = DraftRunner(draft, CACHE)
    for start, count, seed in ((0, 9, 7), (9, 2, 8)):
        propose_trees(runner, [ProposeInput("a", random_rows(start, count, seed=seed), 3)], topk=2, num_draft_tokens=5)
        runner.propose([ProposeInput("b", random_rows(start, count, seed=seed), 3)])
        for pool in (runner.cache.keys, runner.cache.values):
            assert not pool.requires_grad and pool.grad_fn is None


def test_bad_shapes_are_refused(draft: Eagle3Draft) -> None:
    rows = random_rows(0, 4, seed=6)
    with pytest.raises(ValueError, match="num_draft_tokens 1"):
        propose_trees(DraftRunner(draft, CACHE), [ProposeInput("a", rows, 2)], topk=2, num_draft_tokens=1)


@pytest.mark.parametrize(
    ("shape", "num_steps", "message"),
    [
        (TreeShape(0, 0), 3, "--speculative-eagle-topk: 0"),
        (TreeShape(1, 8), 3, "--speculative-num-draft-tokens 8 with --speculative-eagle-topk 1"),
        (TreeShape(4, 14), 3, r"--speculative-num-draft-tokens 14: between 2 and .* = 13"),
        (TreeShape(2, 1), 3, "--speculative-num-draft-tokens 1"),
    ],
)
def test_inconsistent_tree_flags_are_refused_naming_them(shape: TreeShape, num_steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shape.resolved(num_steps)


def test_tree_flags_resolve() -> None:
    assert TreeShape().resolved(5) == TreeShape(1, 6)
    assert TreeShape(4, 8).resolved(3).max_drafts == 7


@pytest.mark.parametrize(
    ("tokens", "parents", "fault"),
    [
        ([5, 6, 7], [-1, -1, 0], ""),
        ([5, 6, 7], [-1, 2, 0], "parents[1]: 2 must be -1 (the root) or an earlier index (0..0)"),
        ([5, 6, 7], [-1, -1], "parents: 2 entries for 3 nodes"),
        ([5] * 8, [-1] * 8, "draft_tokens: 8, at most 7"),
        ([5, 6, 70], [-1, -1, 0], "draft_tokens[2]: 70 is outside the vocabulary [0, 64)"),
    ],
)
def test_the_orchestrator_refuses_a_bad_tree_from_a_replica(tokens: list[int], parents: list[int], fault: str) -> None:
    assert DraftTree(tuple(tokens), tuple(parents)).fault(max_tokens=7, vocab_size=64) == fault
