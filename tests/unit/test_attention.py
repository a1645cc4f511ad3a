"""The torch attention backend against a plain per-query softmax, with and without a sliding window and a scale
override.

Two sequences share one pool. Step 0 prefills sequence A; step 1 packs a 3-token chunk of A (over its cached context)
with the 6-token prefill of B; step 2 decodes one token of each; step 3 adds 3 tokens to each, as a verification of
2 drafts does (contexts of different lengths, pages interleaved). Every query at position p must see exactly the keys
at positions (p - window, p] (all of [0, p] without a window) with softmax scale `scaling` (head_dim ** -0.5 if None).
"""

from __future__ import annotations

import pytest
import torch

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache, SequenceKV

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
STEPS = [{"A": 9}, {"A": 3, "B": 6}, {"A": 1, "B": 1}, {"A": 3, "B": 3}]  # tokens each sequence adds at each step
TOLERANCE = 1e-5


def reference_attention(
    query: torch.Tensor,  # [num_queries, num_heads, head_dim]
    keys: torch.Tensor,  # [context_len, num_kv_heads, head_dim] positions 0..context_len - 1
    values: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_queries] position of each query
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:  # -> [num_queries, num_heads, head_dim]
    group = NUM_HEADS // NUM_KV_HEADS
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scale = HEAD_DIM**-0.5 if scaling is None else scaling
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale  # [num_heads, num_queries, context_len]
    key_positions = torch.arange(keys.shape[0])
    visible = key_positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        visible &= key_positions[None, :] > positions[:, None] - sliding_window
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def attend(
    metadata: AttentionMetadata,
    cache: PagedKVCache,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:  # -> [num_tokens, num_heads, head_dim]
    """What an attention layer of cache layer 0 does with the step's planned backend."""
    return metadata.attention.attend(query, key, value, cache.keys[0], cache.values[0], scaling, sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 1, 4, 64])
@pytest.mark.parametrize("scaling", [None, 0.2])
def test_paged_attention_matches_per_query_softmax(sliding_window: int | None, scaling: float | None) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = {name: sum(step.get(name, 0) for step in STEPS) for name in ("A", "B")}
    queries = {name: torch.randn(length, NUM_HEADS, HEAD_DIM, generator=generator) for name, length in lengths.items()}
    keys = {name: torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator) for name, length in lengths.items()}
    values = {
        name: torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator) for name, length in lengths.items()
    }
    cache = PagedKVCache(1, 16, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    sequences = {name: SequenceKV() for name in lengths}
    checked_rows = 0
    for step in STEPS:
        starts = {name: sequences[name].length for name in step}
        metadata = cache.plan([(sequences[name], count) for name, count in step.items()])
        rows = {name: slice(starts[name], starts[name] + count) for name, count in step.items()}
        output = attend(
            metadata,
            cache,
            torch.cat([queries[name][rows[name]] for name in step]),
            torch.cat([keys[name][rows[name]] for name in step]),
            torch.cat([values[name][rows[name]] for name in step]),
            scaling,
            sliding_window,
        )
        table = metadata.page_table
        for name, packed_rows, kv_len in zip(step, table.query_slices(), table.kv_lens(), strict=True):
            expected = reference_attention(
                queries[name][rows[name]],
                keys[name][:kv_len],
                values[name][:kv_len],
                torch.arange(starts[name], kv_len),
                scaling,
                sliding_window,
            )
            got = output[packed_rows]
            assert (got - expected).abs().max().item() <= TOLERANCE, f"sequence {name} at step {STEPS.index(step)}"
            checked_rows += packed_rows.stop - packed_rows.start
    assert checked_rows == sum(lengths.values())


def test_window_and_scaling_change_the_output() -> None:
    # The options must act: a window shorter than the context, or another scale, gives a different result.
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(6, NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(6, NUM_KV_HEADS, HEAD_DIM, generator=generator)

    def attend_with(scaling: float | None, sliding_window: int | None) -> torch.Tensor:
        cache = PagedKVCache(1, 4, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
        metadata = cache.plan([(SequenceKV(), 6)])
        return attend(metadata, cache, query, key, value, scaling, sliding_window)

    plain = attend_with(None, None)
    assert (attend_with(None, 2) - plain).abs().max().item() > 1e-2
    assert (attend_with(0.9, None) - plain).abs().max().item() > 1e-2
    # A window as long as the context changes nothing.
    assert (attend_with(None, 6) - plain).abs().max().item() <= TOLERANCE


TREES = {
    # page_table's docstring example: rows at positions 5, 6, 6, 7.
    "branching": ([-1, 0, 0, 1], [[0], [0, 1], [0, 2], [0, 1, 3]]),
    # Three roots on the context: node 2 sits at position 5 though it is KV row 7, so a window must go by position.
    "roots": ([-1, -1, -1, 2], [[0], [1], [2], [2, 3]]),
}


@pytest.mark.parametrize("sliding_window", [None, 1, 2])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_tree_rows_see_the_context_and_their_ancestors_only(tree: str, sliding_window: int | None) -> None:
    # Context of 5 positions, then a tree of 4 tokens: each row must equal attention over the context plus its own
    # path (root to itself), the path's keys at positions 5, 6, ... by depth.
    generator = torch.Generator().manual_seed(2)
    parents, paths = TREES[tree]
    query = torch.randn(len(parents), NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(5 + len(parents), NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(5 + len(parents), NUM_KV_HEADS, HEAD_DIM, generator=generator)
    cache = PagedKVCache(1, 8, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    sequence = SequenceKV()
    context = cache.plan([(sequence, 5)])
    attend(context, cache, torch.zeros(5, NUM_HEADS, HEAD_DIM), key[:5], value[:5], None, None)
    metadata = cache.plan([(sequence, len(parents))], parents=[parents])
    assert metadata.positions.tolist() == [5 + len(path) - 1 for path in paths]
    output = attend(metadata, cache, query, key[5:], value[5:], None, sliding_window)
    for row, path in enumerate(paths):
        visible = [*range(5), *(5 + node for node in path)]
        expected = reference_attention(
            query[row : row + 1],
            key[visible],
            value[visible],
            torch.tensor([5 + len(path) - 1]),
            None,
            sliding_window,
        )
        assert (output[row : row + 1] - expected).abs().max().item() <= TOLERANCE, f"tree row {row}"


def test_a_context_in_consecutive_pages_attends_like_a_scattered_one() -> None:
    # A sequence whose pages follow each other is read as one range of the pool; one whose pages are scattered is
    # gathered slot by slot. Both must give the same attention.
    generator = torch.Generator().manual_seed(2)
    queries = torch.randn(11, NUM_HEADS, HEAD_DIM, generator=generator)
    keys = torch.randn(11, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    values = torch.randn(11, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    expected = reference_attention(queries[9:], keys, values, torch.arange(9, 11), None, None)
    for scattered in (False, True):
        cache = PagedKVCache(1, 16, 4, NUM_KV_HEADS, HEAD_DIM, torch.float32)
        sequence = SequenceKV()
        for start, end in ((0, 5), (5, 9), (9, 11)):
            if scattered and start == 5:
                cache.plan([(SequenceKV(), 4)])  # another sequence takes the next page: the sequence's skip one
            metadata = cache.plan([(sequence, end - start)])
            output = attend(metadata, cache, queries[start:end], keys[start:end], values[start:end], None, None)
        plan = metadata.attention.sequences[0]
        assert (plan.context_range is None) == scattered, sequence.block_ids
        assert (output - expected).abs().max().item() <= TOLERANCE
