"""Hybrid drafting (orchestrator/loop/hybrid.py): the trie merge on hand-built answers, the drafter around a replica's
backend, its command line, and a chi-square test that sampling stays lossless when n-gram branches that follow the
sampled tokens are merged into a model's chain or tree (built like tests/unit/test_tree_verify.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from launch.cli import build_parser
from launch.processes import ready_line
from launch.serve_command import serve_settings_of
from launch.service_commands import orchestrator_settings_of
from orchestrator.loop.hybrid import HybridDrafter, merge_branch, with_hybrid
from orchestrator.loop.ngram import NgramDrafter, lookup
from orchestrator.loop.output import Stats
from orchestrator.peers.backends import BackendError, ProposedBatch, ProposeTask
from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem import flags
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.tree_verify import TreeOutcome, verify_tree
from tandem.sampling.verify import verify_sampled
from tandem.settings import TreeShape
from tests.unit.test_sampling_lossless import (
    NUM_CONTROL_TRIALS,
    NUM_TRIALS,
    PARAMS,
    SIGNIFICANCE,
    TARGET_LOGITS,
    first_and_joint_p_values,
)
from tests.unit.test_tree_verify import lossy_walk


def tree(tokens: Sequence[int], parents: Sequence[int] = ()) -> DraftTree:
    """A replica's answer as the wire carries it: no parents for a chain."""
    return DraftTree.of(tokens, parents)


def paths(tokens: Sequence[int], parents: Sequence[int]) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree: what a walk down it can accept."""
    found: dict[int, tuple[int, ...]] = {}
    for node, parent in enumerate(parents):
        found[node] = (*found.get(parent, ()), tokens[node])
    return set(found.values())


def test_worked_example_of_the_docstring() -> None:
    assert merge_branch(tree([5, 6, 7]), [5, 9, 4]) == DraftTree((5, 6, 7, 9, 4), (-1, 0, 1, 0, 3))
    assert merge_branch(tree([5, 6, 7]), [5, 6]) == DraftTree.chain([5, 6, 7])


@pytest.mark.parametrize(
    ("tokens", "parents", "branch"),
    [
        ([5, 6, 7], [], []),  # no lookup match: the chain as it was
        ([], [], [2, 5, 7]),  # the replica proposed nothing: the branch alone, a chain
        ([5, 6, 7], [], [1, 2, 3]),  # no shared prefix: a second root child
        ([1, 2, 3, 4, 5], [-1, -1, 0, 1, 1], [2, 5, 7]),  # a tree: shares nodes 1 and 4, then 7 below node 4
        ([1, 2, 3, 4, 5], [-1, -1, 0, 1, 1], [2, 4]),  # shared whole: the tree as it was
        ([3, 3, 1, 1, 2], [-1, -1, 0, 0, 1], [3, 1, 6]),  # a replica's repeated sibling: the branch follows one
    ],
)
def test_the_merge_is_the_trie_union_and_keeps_the_answer_whole(
    tokens: list[int], parents: list[int], branch: list[int]
) -> None:
    answer = tree(tokens, parents)
    merged = merge_branch(answer, branch)
    assert merged.fault(len(tokens) + len(branch)) == ""
    # The replica's answer is a prefix, unchanged: its nodes keep their indices, tokens and parents.
    assert merged.first(len(tokens)) == answer
    # Exactly the paths of the answer and of the branch, and no node more than the branch's unshared tokens.
    expected = paths(answer.tokens, answer.parents)
    expected |= {tuple(branch[:end]) for end in range(1, len(branch) + 1)}
    assert paths(merged.tokens, merged.parents) == expected
    assert len(merged) <= len(tokens) + len(branch)


class CannedReplica:
    """A DraftBackend answering what it is given, as a replica over gRPC would (tests only)."""

    def __init__(self, answer: ProposedBatch) -> None:
        self.answer = answer
        self.released: list[str] = []

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        return self.answer

    async def release(self, request_ids: Sequence[str]) -> None:
        self.released += request_ids

    async def probe(self) -> None:
        return None


TOKENS = (1, 2, 3, 9, 1, 2)  # the lookup of 1 2 proposes 3 9 1 2 ...


def test_the_drafter_merges_the_lookup_into_each_answer() -> None:
    answer = ProposedBatch(
        {"chain": tree([3, 8]), "tree": tree([3, 4, 8], [-1, -1, 0]), "same": tree([3, 9])},
        {"full": "no KV room"},
        0.25,
    )
    replica = CannedReplica(answer)
    drafter = HybridDrafter(replica, HybridSettings(NgramSettings(max_n=2, min_n=2)), TreeShape(2, 4).resolved(2))
    tasks = [ProposeTask(name, 1, 2, TOKENS) for name in ("chain", "tree", "same", "full")]
    batch = asyncio.run(drafter.propose(tasks))
    assert batch.drafts == {
        "chain": DraftTree((3, 8, 9), (-1, 0, 0)),
        "tree": DraftTree((3, 4, 8, 9), (-1, -1, 0, 0)),
        "same": DraftTree.chain([3, 9]),  # the lookup adds nothing: it stays a chain
    }
    assert batch.exhausted == {"full": "no KV room"}
    assert batch.compute_seconds >= 0.25  # the replica's compute, and the lookups
    asyncio.run(drafter.release(["chain"]))
    assert replica.released == ["chain"]


@pytest.mark.parametrize(
    ("drafts", "parents", "message"),
    [
        ([3, 8, 1], {}, "request r: draft_tokens: 3, at most 2"),
        ([3, 8, 1, 4], {"r": [-1, 0, 0, 1]}, "request r: draft_tokens: 4, at most 3"),
        ([3, 8], {"r": [-1, 1]}, r"request r: parents\[1\]: 1 must be -1"),
    ],
)
def test_a_bad_answer_is_the_replicas_fault_before_any_merge(
    drafts: list[int], parents: dict[str, list[int]], message: str
) -> None:
    drafter = HybridDrafter(
        CannedReplica(ProposedBatch({"r": tree(drafts, parents.get("r", []))}, {}, 0.0)),
        HybridSettings(),
        TreeShape(2, 4).resolved(2),
    )
    with pytest.raises(BackendError, match=message):
        asyncio.run(drafter.propose([ProposeTask("r", 1, 2, TOKENS)]))


def test_the_scheduler_allows_the_branch_room_only_with_hybrid() -> None:
    assert SchedulerSettings(num_steps=5).max_tree_drafts == 5
    assert SchedulerSettings(num_steps=3, tree=TreeShape(4, 8)).max_tree_drafts == 7
    assert SchedulerSettings(num_steps=3, tree=TreeShape(4, 8), hybrid=HybridSettings()).max_tree_drafts == 10
    replica = NgramDrafter(NgramSettings())
    assert with_hybrid(replica, SchedulerSettings()) is replica
    assert isinstance(with_hybrid(replica, SchedulerSettings(hybrid=HybridSettings())), HybridDrafter)


def test_per_request_stats_count_acceptance_by_depth() -> None:
    stats = Stats()
    # A tree of 5 nodes 2 deep that accepted a path of 2, then a chain of 3 that accepted 1, then no drafts.
    for tokens, parents, accepted in (([1, 2, 3, 4, 5], [-1, -1, 0, 1, 1], 2), ([1, 2, 3], [], 1), ([], [], 0)):
        stats.count_round(len(tokens), tree(tokens, parents).depth, accepted)
    assert (stats.rounds, stats.draft_rounds, stats.draft_tokens, stats.accepted_tokens) == (3, 2, 8, 3)
    assert stats.accepted_per_position == [2, 1, 0]  # as wide as the deepest round, not as the largest tree


def test_serve_hybrid_gives_the_orchestrator_its_sizes() -> None:
    settings = serve_settings_of(build_parser().parse_args(["serve", "--hybrid-ngram", "--ngram-max", "5"]))
    hybrid = settings.scheduler.hybrid
    assert hybrid == HybridSettings(NgramSettings(max_n=5, min_n=HybridSettings().ngram.min_n))
    assert settings.ngram is None
    # The orchestrator's command line, as the launcher writes it, parses back to the same sizes.
    orchestrator = settings.orchestrator_settings("a", [], settings.admin_settings(), Path("http.url"))
    arguments = ["orchestrator", *flags.arguments_of(orchestrator)]
    assert orchestrator_settings_of(build_parser().parse_args(arguments)).scheduler.hybrid == hybrid
    assert "with n-gram drafts merged in" in ready_line(settings, "127.0.0.1:5", "3 processes")
    assert serve_settings_of(build_parser().parse_args(["serve"])).scheduler.hybrid is None


def test_hybrid_with_draft_ngram_is_refused() -> None:
    arguments = ["orchestrator", "--target-address", "a", "--tokenizer", "t", "--draft", "ngram", "--hybrid-ngram"]
    args = build_parser().parse_args(arguments)
    with pytest.raises(ValueError, match="--hybrid-ngram merges n-gram drafts into a draft model's"):
        orchestrator_settings_of(args)


# Sampling. TARGET_LOGITS depend on the position only, so the first two committed tokens must follow p_0 x p_1
# whatever is proposed. The n-gram branch is looked up in HISTORY and the tokens committed so far, so it changes
# with what was sampled; rows go by depth: start + depth <= 3 with at most 2 drafts deep.
HISTORY = [2, 0, 3, 1, 0, 2, 5, 1, 4]
MODEL_ANSWERS = {
    "likely-chain": ([0, 1], []),  # the target's most likely tokens at positions 0 and 1
    "likely-tree": ([0, 2, 1, 3, 1], [-1, -1, 0, 0, 1]),
    # Rare and impossible tokens (token 1 at position 1 has probability 0), and a repeated sibling.
    "bad-tree": ([3, 3, 1, 1, 2], [-1, -1, 0, 0, 1]),
}


def hybrid_round(
    committed: list[int], answer: tuple[list[int], list[int]], generator: torch.Generator, lossy: bool
) -> list[int]:
    """One round as the stack runs it: merge the lookup into the answer, then the target's rule for what results (a
    chain: tandem.sampling.verify; a tree: tree_verify), or the lossy tree rule of the negative control."""
    branch = lookup([*HISTORY, *committed], 2, min_n=1, max_n=2)
    merged = merge_branch(tree(*answer), branch)
    start = len(committed)
    rows = TARGET_LOGITS[[start + depth for depth in [0, *merged.depths()]]]  # [1 + n, vocab]
    if lossy:
        return lossy_walk(rows, merged.tokens, merged.parents, generator).tokens
    if merged.is_chain:
        return verify_sampled(rows, list(merged.tokens), PARAMS, generator, None).tokens
    outcome: TreeOutcome = verify_tree(rows, merged, PARAMS, generator)
    return outcome.tokens


def first_two_hybrid_tokens(answer: tuple[list[int], list[int]], trials: int, lossy: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    results = []
    for _ in range(trials):
        committed: list[int] = []
        while len(committed) < 2:
            committed.extend(hybrid_round(committed, answer, generator, lossy))
        results.append(committed[:2])
    return torch.tensor(results)


def test_the_lookup_branch_follows_the_sampled_tokens() -> None:
    # What the sampling test relies on: the merged tree differs with the committed tokens.
    answer = MODEL_ANSWERS["likely-chain"]
    shapes = {merge_branch(tree(*answer), lookup([*HISTORY, token], 2, 1, 2)).tokens for token in range(7)}
    assert len(shapes) >= 4


@pytest.mark.parametrize("name", list(MODEL_ANSWERS))
def test_sampled_hybrid_rounds_follow_the_target_distribution(name: str) -> None:
    first_p_value, joint_p_value = first_and_joint_p_values(first_two_hybrid_tokens(MODEL_ANSWERS[name], NUM_TRIALS))
    assert first_p_value > SIGNIFICANCE
    assert joint_p_value > SIGNIFICANCE


def test_the_check_detects_a_rule_that_keeps_rejected_mass_on_hybrid_trees() -> None:
    tokens = first_two_hybrid_tokens(MODEL_ANSWERS["likely-tree"], NUM_CONTROL_TRIALS, lossy=True)
    first_p_value, _ = first_and_joint_p_values(tokens)
    assert first_p_value < SIGNIFICANCE
