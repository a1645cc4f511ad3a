"""The step planner's page table (FlashInfer's layout) on the worked examples of tandem/layers/page_table.py and
target_server/step.py, checked by hand, and the page table's wire form between tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.layers.page_table import HOST, PlanEntry, build_page_table, tree_mask
from target_server.step import ForwardStep, decode_step, encode_step

T, D = 101, 102  # two token ids


def test_worked_example_of_the_module_docstring() -> None:
    entries = [
        PlanEntry(block_ids=[7, 2], start=5, num_new=2),
        PlanEntry(block_ids=[5], start=0, num_new=3),
        PlanEntry(block_ids=[3, 6, 1], start=4, num_new=4, parents=[-1, 0, 0, 1]),  # block 1 is not needed yet
    ]
    table = build_page_table(entries, page_size=4, device=HOST)
    assert table.qo_indptr.tolist() == [0, 2, 5, 9]
    assert table.kv_indptr.tolist() == [0, 2, 3, 5]
    assert table.kv_page_indices.tolist() == [7, 2, 5, 3, 6]
    assert table.kv_last_page_len.tolist() == [3, 3, 4]
    assert table.positions.tolist() == [5, 6, 0, 1, 2, 4, 5, 5, 6]
    assert table.write_slots.tolist() == [9, 10, 20, 21, 22, 24, 25, 26, 27]
    assert table.custom_masks[:2] == (None, None)
    tree = table.custom_masks[2]
    assert tree is not None
    assert tree.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert (table.qo_indptr.dtype, table.kv_page_indices.dtype) == (torch.int32, torch.int32)
    assert table.kv_lens() == [7, 3, 8]
    assert table.query_slices() == [slice(0, 2), slice(2, 5), slice(5, 9)]
    assert table.last_rows().tolist() == [1, 4, 8]


def test_a_chain_of_parents_is_the_causal_mask() -> None:
    assert torch.equal(tree_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril())


def test_a_full_last_page_has_length_page_size() -> None:
    table = build_page_table([PlanEntry(block_ids=[4, 9], start=3, num_new=5)], page_size=4, device=HOST)
    assert (table.kv_indptr.tolist(), table.kv_last_page_len.tolist()) == ([0, 2], [4])


def test_a_block_table_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="9 KV rows need 3 pages; the block table holds 2"):
        build_page_table([PlanEntry(block_ids=[4, 9], start=3, num_new=6)], page_size=4, device=HOST)


def verify_step(parents: list[int] | None) -> ForwardStep:
    """target_server/step.py's example: KV of positions 0..4 in pages [2, 3], verifying t, d at positions 5, 6."""
    cache = PagedKVCache(1, 8, 4, 1, 8, torch.float32)
    sequence = SequenceKV(block_ids=[2, 3], length=5)
    metadata = cache.plan([(sequence, 2)], parents=[parents])
    logit_rows = torch.tensor([0, 1])
    return ForwardStep(torch.tensor([T, D]), metadata, (2,), logit_rows)


def test_wire_form_of_the_step_docstring_example() -> None:
    chain = encode_step(verify_step(None))
    assert chain.tolist() == [2, 1, 1, 2, 2, 4, 2, T, D, 5, 6, 13, 14, 0, 1, 0, 2, 0, 2, 2, 3, 3, 0]
    tree = encode_step(verify_step([-1, 0]))
    assert tree.tolist() == [*chain.tolist()[:-1], 1, 1, 0, 1, 1]


@pytest.mark.parametrize("parents", [None, [-1, 0], [-1, -1]])
def test_a_decoded_step_is_the_encoded_one(parents: list[int] | None) -> None:
    step = verify_step(parents)
    rank_cache = PagedKVCache(1, 8, 4, 1, 8, torch.float32)
    decoded = decode_step(encode_step(step), rank_cache)
    sent, got = step.metadata.page_table, decoded.metadata.page_table
    assert isinstance(decoded.metadata, AttentionMetadata)
    for name in ("qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_len", "positions", "write_slots"):
        assert torch.equal(getattr(sent, name), getattr(got, name)), name
    assert got.page_size == 4
    assert len(got.custom_masks) == 1
    sent_mask, got_mask = sent.custom_masks[0], got.custom_masks[0]
    assert (sent_mask is None) == (got_mask is None)
    if sent_mask is not None and got_mask is not None:
        assert torch.equal(sent_mask, got_mask)
    assert torch.equal(decoded.input_ids, step.input_ids)
    assert decoded.capture == step.capture
    assert torch.equal(decoded.logit_rows, step.logit_rows)


def test_an_images_span_is_seen_both_ways_and_dropped_for_causal_layers() -> None:
    # Two sequences: A computes 5 prompt tokens, an image at 1..3 of them; B is a tree, which has no spans.
    entries = [PlanEntry([0, 1], 0, 5, spans=[(1, 4)]), PlanEntry([2], 2, 2, parents=[-1, -1])]
    table = build_page_table(entries, 4, HOST)
    image_mask = torch.ones((5, 5), dtype=torch.bool).tril()
    image_mask[1:4, 1:4] = True
    assert table.spanned == (True, False) and table.custom_masks[0] is not None
    assert torch.equal(table.custom_masks[0], image_mask)
    causal = table.without_spans()
    assert causal.custom_masks[0] is None and causal.custom_masks[1] is table.custom_masks[1]
    assert causal.without_spans() is causal and causal.spanned == ()
    # A rank gets the same: its step's metadata plans both, the causal one for layers that attend causally.
    cache = PagedKVCache(1, 8, 4, 1, 8, torch.float32)
    metadata = AttentionMetadata.planned(table, cache.backend)
    step = ForwardStep(torch.arange(7), metadata, (), torch.tensor([4, 6]))
    decoded = decode_step(encode_step(step), cache).metadata
    assert decoded.page_table.spanned == (True, False)
    assert decoded.without_spans().page_table.custom_masks[0] is None
    assert metadata.without_spans() is not metadata and build_page_table(entries[1:], 4, HOST).spanned == ()
