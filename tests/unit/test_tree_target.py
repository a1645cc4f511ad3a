"""The target runner verifying a tree of drafts in one forward (a DraftTree on StepItem.drafts): greedy output equals
target-only greedy decoding, the accepted path's KV is kept and the rest freed, and the draft gets the path's rows."""

from __future__ import annotations

import pytest
import torch

from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from target_server.items import ItemStatus, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_runners import CACHE, CAPTURE, GREEDY, PROMPT, full_forward, greedy_from_scratch

VOCAB = 320


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    return load_target(write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec()))


@pytest.fixture(scope="module")
def reference(target: LlamaForCausalLM) -> list[int]:
    return greedy_from_scratch(target, PROMPT, 16)


def wrong(token: int) -> int:
    return (token + 7) % VOCAB


def test_tree_rounds_give_the_target_only_tokens(target: LlamaForCausalLM, reference: list[int]) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    runner.prefill("a", PROMPT, GREEDY, CAPTURE)
    # Per round: parents, and which nodes hold the right token at their depth (the others hold a wrong one);
    # the expected accepted path.
    rounds = [
        ([-1, -1, 0, 1, 1], {1, 4}, [1, 4]),  # the right branch is the second at the root
        ([-1, -1, 0, 0, 1], {0, 3}, [0, 3]),  # second child of the first node
        ([-1, -1, 1], set(), []),  # nothing right: correction only
        ([-1, 0, 1], {0, 1, 2}, [0, 1, 2]),  # a chain as a tree, all accepted: bonus
    ]
    for parents, right, path in rounds:
        tokens = runner.requests["a"].tokens
        position = len(tokens)
        depths = []
        for parent in parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        drafts = [
            reference[position + depth - 1] if node in right else wrong(reference[position + depth - 1])
            for node, depth in enumerate(depths)
        ]
        (result,) = runner.step([StepItem("a", 1, DraftTree(tuple(drafts), tuple(parents)))])
        assert result.status is ItemStatus.OK, result.message
        assert result.accepted == len(path)
        assert result.new_tokens == reference[position : position + len(path) + 1]
        request = runner.requests["a"]
        assert request.kv.length == len(request.tokens) - 1
        # The rows streamed to the draft are the committed path's, as a chain.
        captured = result.captured
        assert captured is not None
        assert captured.start_position == position - 1
        assert captured.next_tokens == request.tokens[position:]
        _, features = full_forward(target, request.tokens[:-1], CAPTURE)
        assert torch.allclose(captured.features, features[position - 1 :], atol=1e-4)
    # The KV kept from the trees continues exactly like plain decoding.
    result = runner.verify("a")
    assert runner.requests["a"].tokens == reference[: len(runner.requests["a"].tokens)]
    assert result.new_tokens == [reference[len(runner.requests["a"].tokens) - 1]]


def test_a_tree_with_a_bad_parent_is_invalid_and_changes_nothing(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    runner.prefill("a", PROMPT, GREEDY)
    free = runner.cache.num_free_blocks
    (result,) = runner.step([StepItem("a", 1, DraftTree((1, 2), (-1, 1)))])
    assert result.status is ItemStatus.INVALID
    assert "parents[1]: 1 must be -1" in result.message
    assert runner.cache.num_free_blocks == free
    (result,) = runner.step([StepItem("a", 1, DraftTree((1, 2), (-1,)))])
    assert "parents: 1 entries for 2 nodes" in result.message
