"""The prefix cache: block names, the pool's free, shared and cached blocks, and the target runner reusing them
(greedy tokens and logits as without the cache, salts kept apart, preempted requests finding their own blocks, a
pool that overflows evicting without a leak)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.layers.block_pool import BlockPool, block_hashes
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import ItemStatus, OpenRequest, RowStream, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target

BLOCK = 4
CACHE = KVCacheSettings(num_blocks=24, block_size=BLOCK)
SHARED = [1, *range(40, 58)]  # 19 tokens: four full blocks and three more
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    return load_target(write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec()))


def opening(request_id: str, prompt: list[int], salt: str = "", capture: tuple[int, ...] = ()) -> StepItem:
    sampling_open = OpenRequest(prompt, GREEDY, cache_salt=salt)
    return StepItem(request_id, len(prompt), open=sampling_open, stream=RowStream(capture))


def generate(runner: TargetRunner, request_id: str, prompt: list[int], steps: int, salt: str = "") -> tuple[int, list]:
    """Opens a request with its whole prompt, decodes `steps` more tokens; -> cached tokens, new tokens."""
    (first,) = runner.step([opening(request_id, prompt, salt)])
    assert first.status is ItemStatus.OK, first.message
    tokens = list(first.new_tokens)
    for _ in range(steps):
        (result,) = runner.step([StepItem(request_id, 1)])
        tokens += result.new_tokens
    return first.cached_tokens, tokens


def test_block_names_chain_over_every_earlier_token_and_the_salt() -> None:
    names = block_hashes(list(range(10)), 4, "")
    assert len(names) == 2  # the partial third block has no name
    assert block_hashes(list(range(8)), 4, "") == names
    assert block_hashes([0, 1, 2, 3, 4, 5, 6, 99], 4, "")[0] == names[0]
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, "")[1] != names[1]  # a change before the block renames it
    assert set(block_hashes(list(range(8)), 4, "tenant")).isdisjoint(names)
    assert block_hashes(list(range(12)), 4, "", known=names) == block_hashes(list(range(12)), 4, "")


def test_a_mark_names_its_block_and_every_later_one() -> None:
    # An image from token 5 (block 1 of 4-token blocks): block 0 keeps its name, blocks 1 and 2 take the digest.
    tokens = list(range(12))
    plain = block_hashes(tokens, 4, "")
    one, other = block_hashes(tokens, 4, "", marks=[(5, "aa")]), block_hashes(tokens, 4, "", marks=[(5, "bb")])
    assert one[0] == other[0] == plain[0]
    assert len({one[1], other[1], plain[1]}) == 3 and len({one[2], other[2], plain[2]}) == 3
    assert block_hashes(tokens, 4, "", marks=[(4, "aa")]) == one  # where in the block does not matter
    assert block_hashes(tokens, 4, "", known=one[:1], marks=[(5, "aa")]) == one


def test_pool_takes_never_named_blocks_first_then_evicts_the_oldest_cached() -> None:
    pool = BlockPool(3, caching=True)
    first, second, third = pool.take(), pool.take(), pool.take()
    pool.publish(first, b"a")
    pool.publish(second, b"b")
    pool.give_back(second)
    pool.give_back(first)  # freed after `second`: the newer of the two cached blocks
    pool.give_back(third)
    assert (pool.num_free, pool.num_cached) == (3, 2)
    assert pool.take() == third  # never named
    assert pool.take() == second and pool.find(b"b") is None and pool.find(b"a") == first
    pool.share(first)
    assert pool.num_free == 0
    with pytest.raises(IndexError):
        pool.take()


def computed(cache: PagedKVCache, tokens: list[int], length: int) -> SequenceKV:
    """A sequence holding KV of tokens[:length], as a step leaves it, its full blocks published."""
    sequence = SequenceKV()
    cache.reserve(sequence, length)
    sequence.length = length
    cache.publish(sequence, tokens, "")
    return sequence


def test_a_shared_block_stays_held_until_its_last_holder_lets_it_go() -> None:
    cache = PagedKVCache(1, 4, BLOCK, 1, 2, torch.float32, prefix_caching=True)
    tokens = list(range(9))
    owner = computed(cache, tokens, 9)
    assert len(owner.hashes) == 2
    reader = SequenceKV()
    assert cache.reuse(reader, tokens, "", end=8) == 8 and reader.block_ids == owner.block_ids[:2]
    assert cache.reuse(SequenceKV(), tokens, "other", end=8) == 0
    cache.release(owner)
    assert cache.num_free_blocks == 2 and cache.blocks.num_cached == 0  # the reader still holds both named ones
    cache.release(reader)
    assert cache.num_free_blocks == 4 and cache.blocks.num_cached == 2


def test_a_repeated_prompt_reuses_whole_blocks_and_decodes_the_same(target: LlamaForCausalLM) -> None:
    cached = TargetRunner(target, replace(CACHE, num_blocks=64), max_context=64)
    uncached = TargetRunner(target, replace(CACHE, num_blocks=64, prefix_caching=False), max_context=64)
    assert generate(uncached, "a", SHARED, 6) == generate(uncached, "b", SHARED, 6)
    hits, reference = generate(uncached, "c", SHARED, 6)
    assert hits == 0
    assert generate(cached, "a", SHARED, 6) == (0, reference)
    # The last prompt token is computed (its logits give the first token): 18 tokens, four whole blocks.
    assert generate(cached, "b", SHARED, 6) == (16, reference)
    longer = [*SHARED, *reference[:5]]  # a second turn: the first turn's blocks include its generated tokens
    assert generate(cached, "c", longer, 2) == (20, generate(uncached, "d", longer, 2)[1])
    assert generate(cached, "e", SHARED, 0, salt="tenant")[0] == 0
    assert generate(cached, "f", SHARED, 0, salt="tenant")[0] == 16


def test_reused_kv_gives_the_logits_a_full_prefill_gives(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    generate(runner, "a", SHARED, 0)
    request = runner.requests["a"]
    table = request.kv.block_ids[:4]
    generate(runner, "b", SHARED, 0)
    assert runner.requests["b"].kv.block_ids[:4] == table  # the same blocks, read by both
    keys = runner.cache.keys[:, runner.cache.slots(runner.requests["b"].kv, 0, 16)]
    fresh = TargetRunner(target, replace(CACHE, prefix_caching=False), max_context=64)
    generate(fresh, "a", SHARED, 0)
    reference = fresh.cache.keys[:, fresh.cache.slots(fresh.requests["a"].kv, 0, 16)]
    assert torch.equal(keys, reference)


def test_rows_for_a_draft_are_computed_not_reused(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    generate(runner, "a", SHARED, 0)
    (result,) = runner.step([opening("b", SHARED, capture=(1, 2))])
    assert result.cached_tokens == 0 and result.captured is not None
    assert result.captured.start_position == 0 and len(result.captured.next_tokens) == len(SHARED)


def test_chunks_reuse_from_block_boundaries(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    _, reference = generate(runner, "a", SHARED, 3)
    (chunk,) = runner.step([replace(opening("b", SHARED), num_tokens=8)])  # all cached: nothing computed
    assert chunk.cached_tokens == 8 and runner.requests["b"].kv.length == 8
    (rest,) = runner.step([StepItem("b", len(SHARED) - 8)])
    assert rest.cached_tokens == 8 and rest.new_tokens == reference[:1]
    # A chunk that ends inside a block computes the rest of that block; its next chunk starts mid-block and
    # computes everything.
    (part,) = runner.step([replace(opening("c", SHARED), num_tokens=6)])
    (tail,) = runner.step([StepItem("c", len(SHARED) - 6)])
    assert (part.cached_tokens, tail.cached_tokens, tail.new_tokens) == (4, 0, reference[:1])


def test_a_preempted_request_finds_its_own_blocks(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    generate(runner, "a", SHARED, 6)
    tokens = list(runner.requests["a"].tokens)
    runner.step([], preempt=["a"])
    (recomputed,) = runner.step([StepItem("a", len(tokens))])
    assert recomputed.cached_tokens == (len(tokens) - 1) // BLOCK * BLOCK
    (following,) = runner.step([StepItem("a", 1)])
    assert [*recomputed.new_tokens, *following.new_tokens] == generate(
        TargetRunner(target, CACHE, max_context=64), "x", SHARED, 8
    )[1][7:9]


def test_a_pool_that_overflows_evicts_and_leaks_nothing(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, replace(CACHE, num_blocks=8), max_context=64)
    uncached = TargetRunner(target, replace(CACHE, num_blocks=8, prefix_caching=False), max_context=64)
    for index in range(6):  # each prompt takes 5 blocks of the 8: every one evicts what the last one left
        prompt = [1, *range(60 + 20 * index, 78 + 20 * index)]
        assert generate(runner, f"r{index}", prompt, 2)[1] == generate(uncached, f"r{index}", prompt, 2)[1]
        runner.release([f"r{index}"])
        uncached.release([f"r{index}"])
        assert runner.cache.num_free_blocks == 8
    assert runner.cache.blocks.num_cached > 0


def test_a_chunk_streaming_to_a_caching_draft_sends_rows_that_name_the_prefix(target: LlamaForCausalLM) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    generate(runner, "a", SHARED, 3)
    stream = RowStream((1, 2), prefix_caching=True)
    item = StepItem("b", 12, open=OpenRequest(SHARED, GREEDY), stream=stream)  # a chunk of three cached blocks
    (chunk,) = runner.step([item])
    # The last block found is computed again: the replica's KV of it depends on the token after it.
    assert chunk.cached_tokens == 8 and chunk.captured is not None
    assert (chunk.captured.start_position, chunk.captured.prefix) == (8, tuple(SHARED[:9]))
    (rest,) = runner.step([StepItem("b", len(SHARED) - 12)])
    assert rest.cached_tokens == 0 and rest.captured is not None and rest.captured.prefix == ()
    # A block drafter's context of a position is its feature alone (prefix_shift 0): every block found is reused.
    block_stream = RowStream((1, 2), prefix_caching=True, prefix_shift=0)
    (whole,) = runner.step([StepItem("c", len(SHARED), open=OpenRequest(SHARED, GREEDY), stream=block_stream)])
    assert whole.cached_tokens == 16 and whole.captured is not None
    assert (whole.captured.start_position, whole.captured.prefix) == (16, tuple(SHARED[:17]))
    # A chunk found whole still sends rows, which name the prefix before the next chunk's rows.
    (cut,) = runner.step([StepItem("d", 12, open=OpenRequest(SHARED, GREEDY), stream=block_stream)])
    assert cut.cached_tokens == 8 and cut.captured is not None
    assert (cut.captured.start_position, cut.captured.prefix) == (8, tuple(SHARED[:9]))


def test_a_sequence_gets_blocks_that_follow_each_other_where_it_can() -> None:
    cache = PagedKVCache(1, 16, BLOCK, 1, 2, torch.float32, prefix_caching=True)
    tokens = list(range(64))
    cache.release(
        computed(cache, tokens, 64)
    )  # every block named and cached, the tail freed first: the least recent is block 15
    grown = SequenceKV()
    cache.reserve(grown, 24)  # evicts six cached blocks, 15 down to 10, taken in increasing order
    assert grown.block_ids == [10, 11, 12, 13, 14, 15]
    cache.release(grown)  # unnamed now, free again (the tail first)
    other = SequenceKV()
    cache.reserve(other, 4)
    cache.reserve(other, 8)  # a step later it grows into the block after its last one
    assert other.block_ids == [10, 11]


def test_a_sequence_growing_after_shared_blocks_evicts_no_cached_prefix() -> None:
    cache = PagedKVCache(1, 16, BLOCK, 1, 2, torch.float32, prefix_caching=True)
    tokens = list(range(64))
    cache.release(computed(cache, tokens, 24))  # blocks 0..5 cached
    reader = SequenceKV()
    assert cache.reuse(reader, [*tokens[:16], 99, 99, 99, 99], "", end=17) == 16  # shares blocks 0..3
    cache.reserve(reader, 20)  # block 4 follows but holds the owner's prefix: a free block is taken instead
    assert reader.block_ids[4] not in (4, 5) and cache.blocks.num_cached == 2
    assert cache.reuse(SequenceKV(), tokens, "", end=24) == 24  # the whole prefix is still there
