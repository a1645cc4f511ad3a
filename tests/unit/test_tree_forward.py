"""A target forward over a tree of new tokens gives, on each branch's rows, what running that branch alone as a chain
gives; `PagedKVCache.keep` then leaves the accepted branch's KV as if only that branch had been run.

Tiny random targets of three attention kinds: Llama (grouped-query attention), Gemma3 (sliding-window layers, the
window shorter than prompt plus tree) and DeepSeek-V3 (MLA). The tree sits after a 10-token prompt, packed in one
step with another sequence's chain chunk:

    node:    0  1  2  3  4  5        branches (root to leaf): 0-1-2, 0-3-4, 0-3-5
    parent: -1  0  1  0  3  3
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.registry import TargetModel, load_target
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.deepseek_checkpoints import write_tiny_deepseek
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.helpers.parity import TOLERANCE, make_cache, token_ids

PARENTS = [-1, 0, 1, 0, 3, 3]
BRANCHES = [[0, 1, 2], [0, 3, 4], [0, 3, 5]]
PROMPT = token_ids(10, seed=11)
OTHER_PROMPT, OTHER_CHUNK = token_ids(5, seed=12), token_ids(3, seed=13)
TREE = token_ids(len(PARENTS), seed=14)

WRITERS: dict[str, Callable[[Path], Path]] = {
    "llama": lambda directory: write_tiny_target(directory, TinyTargetSpec()),
    "gemma3-sliding-window": lambda directory: write_tiny_gemma3(directory, TinyGemma3Spec()),
    "deepseek-v3-mla": write_tiny_deepseek,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    return load_target(WRITERS[request.param](tmp_path_factory.mktemp(request.param)))


def forward(
    model: TargetModel,
    cache: PagedKVCache,
    steps: Sequence[tuple[SequenceKV, Sequence[int], Sequence[int] | None]],  # (sequence, new tokens, parents)
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per sequence: logits [n, vocab], captured streams [n, layers, hidden]
    """One packed forward; returns each sequence's logits and every captured residual stream of its rows."""
    metadata = cache.plan([(kv, len(tokens)) for kv, tokens, _ in steps], parents=[tree for _, _, tree in steps])
    input_ids = torch.tensor([token for _, tokens, _ in steps for token in tokens])
    capture = list(range(model.config.num_layers + 1))
    with torch.no_grad():
        output = model(input_ids, metadata, cache, capture)
        logits = model.compute_logits(output.normed)
    streams = torch.stack([output.captured[index] for index in capture], dim=1)
    return [(logits[rows], streams[rows]) for rows in metadata.page_table.query_slices()]


def run_chain(model: TargetModel, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """PROMPT, then `tokens` as a chain, on a fresh cache: the logits and streams of `tokens`' rows."""
    cache, sequence = make_cache(model), SequenceKV()
    forward(model, cache, [(sequence, PROMPT, None)])
    return forward(model, cache, [(sequence, tokens, None)])[0]


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return (got - expected).abs().max().item() <= TOLERANCE


def test_each_branch_of_a_tree_equals_the_branch_run_as_a_chain(model: TargetModel) -> None:
    cache, sequence, other = make_cache(model), SequenceKV(), SequenceKV()
    forward(model, cache, [(sequence, PROMPT, None), (other, OTHER_PROMPT, None)])
    (other_logits, other_streams), (tree_logits, tree_streams) = forward(
        model, cache, [(other, OTHER_CHUNK, None), (sequence, TREE, PARENTS)]
    )
    for branch in BRANCHES:
        chain_logits, chain_streams = run_chain(model, [TREE[node] for node in branch])
        assert close(tree_logits[branch], chain_logits), f"logits of branch {branch}"
        assert close(tree_streams[branch], chain_streams), f"hidden states of branch {branch}"
    # The chain packed beside the tree is untouched by its mask.
    other_cache, other_alone = make_cache(model), SequenceKV()
    forward(model, other_cache, [(other_alone, OTHER_PROMPT, None)])
    alone_logits, alone_streams = forward(model, other_cache, [(other_alone, OTHER_CHUNK, None)])[0]
    assert close(other_logits, alone_logits)
    assert close(other_streams, alone_streams)


def test_the_same_tokens_without_the_tree_mask_differ(model: TargetModel) -> None:
    # Negative control: as a plain chain, node 3 would also see nodes 1 and 2, so the tree test can fail.
    cache, sequence = make_cache(model), SequenceKV()
    forward(model, cache, [(sequence, PROMPT, None)])
    chain_logits, _ = forward(model, cache, [(sequence, TREE, None)])[0]
    branch = BRANCHES[1]
    expected, _ = run_chain(model, [TREE[node] for node in branch])
    assert not close(chain_logits[branch], expected)


def test_keeping_the_accepted_branch_continues_like_the_chain(model: TargetModel) -> None:
    # Verify the tree, keep branch 0-3-5 (KV rows 10, 13, 15), then decode one more token: it must see exactly the
    # prompt and that branch, as if the branch alone had been run.
    branch = BRANCHES[2]
    next_token = token_ids(1, seed=15)
    cache, sequence = make_cache(model), SequenceKV()
    forward(model, cache, [(sequence, PROMPT, None)])
    forward(model, cache, [(sequence, TREE, PARENTS)])
    cache.keep(sequence, [len(PROMPT) + node for node in branch])
    assert sequence.length == len(PROMPT) + len(branch)
    kept_logits, kept_streams = forward(model, cache, [(sequence, next_token, None)])[0]
    chain_logits, chain_streams = run_chain(model, [*(TREE[node] for node in branch), *next_token])
    assert close(kept_logits, chain_logits[-1:])
    assert close(kept_streams, chain_streams[-1:])
