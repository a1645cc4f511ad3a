"""Paged KV cache bookkeeping: slots, block reservation and return, all-or-nothing planning, keeping a tree's path."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV

BLOCK_SIZE = 4


def make_cache(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(
        num_layers=2, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )


def test_pool_shape() -> None:
    cache = make_cache(num_blocks=5)
    assert cache.keys.shape == (2, 5 * BLOCK_SIZE, 2, 8)
    assert cache.values.shape == (2, 5 * BLOCK_SIZE, 2, 8)
    assert cache.num_free_blocks == 5


def test_slot_arithmetic_follows_the_block_table() -> None:
    cache = make_cache()
    # The module docstring's example: block_ids [7, 2], position 5 -> block 2, offset 1 -> slot 9.
    sequence = SequenceKV(block_ids=[7, 2], length=8)
    assert cache.slots(sequence, 5, 6).tolist() == [9]
    assert cache.slots(sequence, 0, 8).tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    assert cache.slots(sequence, 3, 5).tolist() == [31, 8]


def test_blocks_needed_rounds_up() -> None:
    cache = make_cache()
    sequence = SequenceKV()
    assert [cache.blocks_needed(sequence, length) for length in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    cache.reserve(sequence, 5)
    assert cache.blocks_needed(sequence, 8) == 0
    assert cache.blocks_needed(sequence, 9) == 1


def test_reserve_takes_distinct_blocks_and_release_returns_them() -> None:
    cache = make_cache(num_blocks=8)
    first, second = SequenceKV(), SequenceKV()
    cache.reserve(first, 9)  # 3 blocks
    cache.reserve(second, 4)  # 1 block
    assert len(first.block_ids) == 3
    assert len(second.block_ids) == 1
    assert len(set(first.block_ids) | set(second.block_ids)) == 4
    assert cache.num_free_blocks == 4
    # Reserving a length already covered takes nothing.
    cache.reserve(first, 12)
    assert cache.num_free_blocks == 4

    first.length = 9
    cache.release(first)
    assert first.block_ids == []
    assert first.length == 0
    assert cache.num_free_blocks == 7


def test_reserve_out_of_blocks_changes_nothing() -> None:
    cache = make_cache(num_blocks=2)
    sequence = SequenceKV()
    with pytest.raises(OutOfKVBlocks, match="need 3 more blocks, 2 free"):
        cache.reserve(sequence, 9)
    assert sequence.block_ids == []
    assert cache.num_free_blocks == 2


def test_truncate_to_mid_block_keeps_that_block() -> None:
    cache = make_cache(num_blocks=8)
    sequence = SequenceKV()
    cache.plan([(sequence, 10)])  # positions 0..9 in 3 blocks
    blocks = list(sequence.block_ids)
    assert cache.num_free_blocks == 5

    cache.truncate(sequence, 6)  # position 5 still lives in the second block
    assert sequence.length == 6
    assert sequence.block_ids == blocks[:2]
    assert cache.num_free_blocks == 6

    cache.truncate(sequence, 4)  # exactly one full block left
    assert sequence.block_ids == blocks[:1]
    assert cache.num_free_blocks == 7


def test_truncate_beyond_length_is_a_no_op() -> None:
    cache = make_cache()
    sequence = SequenceKV()
    cache.plan([(sequence, 5)])
    blocks = list(sequence.block_ids)
    cache.truncate(sequence, 20)
    assert sequence.length == 5
    assert sequence.block_ids == blocks


def test_returned_blocks_are_reused() -> None:
    cache = make_cache(num_blocks=3)
    first, second = SequenceKV(), SequenceKV()
    cache.plan([(first, 12)])
    assert cache.num_free_blocks == 0
    cache.truncate(first, 4)
    cache.plan([(second, 8)])  # needs the two blocks the truncation returned
    assert set(second.block_ids).isdisjoint(first.block_ids)
    assert sorted(first.block_ids + second.block_ids) == [0, 1, 2]


def test_plan_packs_sequences_and_advances_lengths() -> None:
    cache = make_cache(num_blocks=8)
    first, second = SequenceKV(), SequenceKV()
    cache.plan([(first, 3)])
    metadata = cache.plan([(first, 3), (second, 2)])  # first: positions 3..5; second: 0..1

    assert (first.length, second.length) == (6, 2)
    assert metadata.positions.tolist() == [3, 4, 5, 0, 1]
    expected_writes = torch.cat([cache.slots(first, 3, 6), cache.slots(second, 0, 2)])
    assert metadata.page_table.write_slots.tolist() == expected_writes.tolist()
    table = metadata.page_table
    assert table.qo_indptr.tolist() == [0, 3, 5]
    assert table.kv_indptr.tolist() == [0, 2, 3]
    assert table.kv_page_indices.tolist() == first.block_ids + second.block_ids
    assert table.kv_last_page_len.tolist() == [2, 2]  # 6 = 4 + 2 rows, 2 rows
    assert table.kv_lens() == [6, 2]
    assert table.custom_masks == (None, None)


def test_plan_is_all_or_nothing_when_out_of_blocks() -> None:
    cache = make_cache(num_blocks=4)
    first, second = SequenceKV(), SequenceKV()
    cache.plan([(first, 2)])
    free_before = cache.num_free_blocks  # 3
    # first needs 1 more block (to 6 positions), second 3 (9 positions): 4 > 3 free.
    with pytest.raises(OutOfKVBlocks, match="need 4 more blocks, 3 free"):
        cache.plan([(first, 4), (second, 9)])
    assert cache.num_free_blocks == free_before
    assert (first.length, len(first.block_ids)) == (2, 1)
    assert (second.length, second.block_ids) == (0, [])


def test_plan_refuses_a_bad_tree_before_reserving() -> None:
    cache = make_cache(num_blocks=4)
    sequence = SequenceKV()
    with pytest.raises(ValueError, match=r"parents\[0\]\[2\]: 2 must be -1 \(the root\) or an earlier index"):
        cache.plan([(sequence, 3)], parents=[[-1, 0, 2]])
    with pytest.raises(ValueError, match=r"parents\[0\]: 2 entries for 3 nodes"):
        cache.plan([(sequence, 3)], parents=[[-1, 0]])
    assert (cache.num_free_blocks, sequence.length) == (4, 0)


def test_keep_moves_the_kept_rows_down_and_frees_the_rest() -> None:
    # The docstring's example: length 10, keep [6, 8, 9] -> 0..6 stay, 8 -> 7, 9 -> 8, length 9.
    cache = make_cache(num_blocks=8)
    sequence = SequenceKV()
    cache.plan([(sequence, 10)])  # 3 blocks
    slots = cache.slots(sequence, 0, 10)
    rows = torch.arange(10, dtype=torch.float32)  # position p's KV holds p everywhere, in every layer
    cache.keys[:, slots] = rows[None, :, None, None]
    cache.values[:, slots] = -rows[None, :, None, None]

    cache.keep(sequence, [6, 8, 9])

    assert sequence.length == 9
    kept = cache.slots(sequence, 0, 9)
    expected = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9], dtype=torch.float32)
    for layer in range(2):
        assert cache.keys[layer, kept, 0, 0].tolist() == expected.tolist()
        assert cache.values[layer, kept, 1, 7].tolist() == (-expected).tolist()
    assert cache.num_free_blocks == 8 - 3  # 9 positions still take 3 blocks
    cache.keep(sequence, [2, 5])  # 0..2 stay, 5 -> 3: 4 positions, one block returns
    assert sequence.length == 4
    assert cache.keys[0, cache.slots(sequence, 0, 4), 0, 0].tolist() == [0, 1, 2, 5]
    assert cache.num_free_blocks == 8 - 1


def test_keep_refuses_positions_out_of_order_or_range() -> None:
    cache = make_cache()
    sequence = SequenceKV()
    cache.plan([(sequence, 6)])
    with pytest.raises(ValueError, match=r"positions\[1\] is 3; positions must increase"):
        cache.keep(sequence, [4, 3])
    with pytest.raises(ValueError, match=r"positions\[0\] is 6; .* below the sequence's length 6"):
        cache.keep(sequence, [6])
    with pytest.raises(ValueError, match="no positions given"):
        cache.keep(sequence, [])
    assert sequence.length == 6
