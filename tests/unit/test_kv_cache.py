"""Paged KV cache bookkeeping: slots, block reservation and return, all-or-nothing planning."""

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
    assert metadata.write_slots.tolist() == expected_writes.tolist()
    first_span, second_span = metadata.spans
    assert (first_span.query_start, first_span.query_len, first_span.context_len) == (0, 3, 6)
    assert (second_span.query_start, second_span.query_len, second_span.context_len) == (3, 2, 2)
    assert first_span.context_slots.tolist() == cache.slots(first, 0, 6).tolist()
    assert second_span.context_slots.tolist() == cache.slots(second, 0, 2).tolist()


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
