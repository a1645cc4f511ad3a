"""Paged KV cache: fixed-size blocks from one preallocated pool, a block table per sequence.

A position p of a sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size`
of the flat pool. Example with block_size 4 and block_ids [7, 2]: position 5 -> block 2, offset 1
-> slot 9. Rolling back rejected draft tokens is a `truncate`; keeping the accepted path of a tree is a `keep`;
finished requests `release` their blocks. The blocks are FlashInfer's pages: one layer's pool viewed as
[num_blocks, block_size, kv_heads, dim] is its "NHD" paged layout, and `plan` builds each step's page table
(tandem.layers.page_table) and has the cache's attention backend plan it (tandem.layers.attention_backend).

With prefix caching, full blocks of final KV are named and shared (`publish`, `reuse`; tandem.layers.block_pool):
a freed named block keeps its KV until a new block is needed.

What a slot holds is the model's `CacheLayout`: a key row and a value row per KV head (multi-head attention), or
one compressed row and no values (MLA).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.layers.attention_backend import AttentionBackend, AttentionMetadata, backend_named, default_backend
from tandem.layers.block_pool import BlockPool, Marks, block_hashes
from tandem.layers.page_table import HOST, PageTable, PlanEntry, build_page_table
from tandem.sampling.draft_tree import check_parents
from tandem.settings import KVCacheSettings


class OutOfKVBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


@dataclass
class SequenceKV:
    block_ids: list[int] = field(default_factory=list)
    length: int = 0  # positions [0, length) hold valid KV
    # The names of the first len(hashes) blocks, each full of final KV (tandem.layers.block_pool); the blocks
    # themselves may be shared with other sequences.
    hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class CacheLayout:
    """What one token leaves in one layer of the cache: keys [num_kv_heads, key_dim], values [num_kv_heads, value_dim].

    Multi-head attention keeps both (key_dim == value_dim == head_dim). MLA keeps one row per token, the normalized
    kv latent followed by the rope'd key part (num_kv_heads 1, key_dim kv_lora_rank + qk_rope_head_dim), and reads its
    values out of that same row, so value_dim is 0.
    """

    num_kv_heads: int
    key_dim: int
    value_dim: int

    def token_bytes(self, num_layers: int, dtype: torch.dtype) -> int:
        """What one token takes in a pool of `num_layers` layers of this layout (every layer holds every token: a
        sliding window limits what attention reads, not what the pool keeps)."""
        return num_layers * self.num_kv_heads * (self.key_dim + self.value_dim) * dtype.itemsize


class PagedKVCache:
    @classmethod
    def for_layout(
        cls, num_layers: int, layout: CacheLayout, settings: KVCacheSettings, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        """The pool `settings` asks for, shaped by what one token leaves in one layer (`layout`)."""
        return cls(
            num_layers,
            settings.blocks_for(settings.block_size * layout.token_bytes(num_layers, dtype)),
            settings.block_size,
            layout.num_kv_heads,
            layout.key_dim,
            dtype,
            device,
            value_dim=layout.value_dim,
            backend=backend_named(settings.attention_backend, torch.device(device), dtype),
            scratch_block=settings.cuda_graphs,
            prefix_caching=settings.prefix_caching,
        )

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,  # width of a value row; None: head_dim; 0: no values (MLA, see CacheLayout)
        backend: AttentionBackend | None = None,  # None: the default backend for the device
        scratch_block: bool = False,  # one more block, never handed out: where padded rows write (CUDA graphs)
        prefix_caching: bool = False,  # full blocks of final KV are kept and shared by name (reuse, publish)
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Block num_blocks, past the ones sequences get: the rows a CUDA graph pads a step with write and read there
        # (tandem.layers.cuda_graphs), so that padding never touches a sequence's KV.
        self.scratch_block: int | None = num_blocks if scratch_block else None
        num_slots = (num_blocks + (1 if scratch_block else 0)) * block_size
        value_width = head_dim if value_dim is None else value_dim
        # [layers, slots, kv_heads, head_dim] and [layers, slots, kv_heads, value_width]
        self.keys = torch.zeros((num_layers, num_slots, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((num_layers, num_slots, num_kv_heads, value_width), dtype=dtype, device=device)
        self.blocks = BlockPool(num_blocks, prefix_caching)
        self.device = torch.device(device)
        self.backend = backend if backend is not None else default_backend(self.device, dtype)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take now, cached ones included (a cached block is evicted when taken)."""
        return self.blocks.num_free

    def blocks_needed(self, sequence: SequenceKV, length: int) -> int:
        return max(0, -(-length // self.block_size) - len(sequence.block_ids))

    def reserve(self, sequence: SequenceKV, length: int) -> None:
        """Makes room for positions [0, length); raises OutOfKVBlocks and changes nothing if the pool is short."""
        needed = self.blocks_needed(sequence, length)
        if needed > self.num_free_blocks:
            raise OutOfKVBlocks(f"KV cache: need {needed} more blocks, {self.num_free_blocks} free")
        taken: list[int] = []
        for _ in range(needed):  # each after the last where it can, in increasing order (blocks that follow each other)
            last = taken[-1] if taken else sequence.block_ids[-1] if sequence.block_ids else None
            taken.append(self.blocks.take(last))
        sequence.block_ids.extend(sorted(taken))

    def truncate(self, sequence: SequenceKV, length: int) -> None:
        """Forgets positions >= length and returns blocks that no longer hold any valid position."""
        sequence.length = min(sequence.length, length)
        keep = -(-sequence.length // self.block_size)
        for block in reversed(sequence.block_ids[keep:]):  # tail first: the cache evicts tails first
            self.blocks.give_back(block)
        del sequence.block_ids[keep:]
        del sequence.hashes[sequence.length // self.block_size :]

    def release(self, sequence: SequenceKV) -> None:
        self.truncate(sequence, 0)

    def reuse(self, sequence: SequenceKV, tokens: Sequence[int], salt: str, end: int, marks: Marks = ()) -> int:
        """Extends a sequence whose KV ends at a named block with the cached blocks that hold the KV of tokens[:end]
        (whole blocks, in order, while they are found); returns the positions it gained (0 without caching).
        `marks`: the request's images (block_pool.block_hashes)."""
        size = self.block_size
        named = len(sequence.hashes)
        if end - sequence.length < size or sequence.length != named * size or len(sequence.block_ids) != named:
            return 0
        if not self.blocks.caching:
            return 0
        names = block_hashes(tokens[:end], size, salt, sequence.hashes, marks)
        for name in names[named:]:
            block = self.blocks.find(name)
            if block is None:
                break
            self.blocks.share(block)
            sequence.block_ids.append(block)
            sequence.hashes.append(name)
        gained = (len(sequence.hashes) - named) * size
        sequence.length += gained
        return gained

    def publish(self, sequence: SequenceKV, tokens: Sequence[int], salt: str, marks: Marks = ()) -> None:
        """Names the sequence's full blocks below its length, whose KV must be final (`tokens` committed), so that
        `reuse` finds them for other sequences and for this one once it is freed."""
        full = sequence.length // self.block_size
        if not self.blocks.caching or full <= len(sequence.hashes):
            return
        names = block_hashes(tokens[: full * self.block_size], self.block_size, salt, sequence.hashes, marks)
        for index in range(len(sequence.hashes), full):
            self.blocks.publish(sequence.block_ids[index], names[index])
        sequence.hashes = names

    def slots(self, sequence: SequenceKV, start: int, end: int) -> torch.Tensor:  # -> [end - start] on the host
        positions = torch.arange(start, end, device=HOST)
        table = torch.tensor(sequence.block_ids, dtype=torch.long, device=HOST)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def plan(
        self,
        sequences: Sequence[tuple[SequenceKV, int]],
        parents: Sequence[Sequence[int] | None] | None = None,  # per sequence: its new tokens' tree, None: a chain
        bidirectional: bool = False,  # every sequence's new tokens see each other both ways (no parents then)
    ) -> AttentionMetadata:
        """Plans one packed forward (see plan_table) and has the cache's attention backend plan its page table."""
        return AttentionMetadata.planned(self.plan_table(sequences, parents, bidirectional), self.backend)

    def plan_table(
        self,
        sequences: Sequence[tuple[SequenceKV, int]],
        parents: Sequence[Sequence[int] | None] | None = None,
        bidirectional: bool = False,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,  # per chain: its new tokens' two-way runs
    ) -> PageTable:
        """The page table of one packed forward: each (sequence, num_new) appends num_new tokens at sequence.length.

        A sequence with parents gets a tree of new tokens (tandem.layers.page_table.tree_mask: parents[i] is -1 or
        an earlier index); each token sees the context and its ancestors. `bidirectional` (no parents): each new token
        sees the context and every new token of its sequence (tandem.layers.page_table). `spans` (chains only): runs
        of a sequence's new tokens that see each other both ways (tandem.layers.page_table.chain_mask). Reserves
        blocks for all sequences first (all or nothing, after the trees are checked), then advances their lengths.
        """
        trees = list(parents) if parents is not None else [None] * len(sequences)
        runs = list(spans) if spans is not None else [()] * len(sequences)
        if len(trees) != len(sequences):
            raise ValueError(f"parents: {len(trees)} entries for {len(sequences)} sequences")
        if bidirectional and parents is not None:
            raise ValueError("parents: a bidirectional step has no trees")
        for index, ((_, num_new), tree) in enumerate(zip(sequences, trees, strict=True)):
            if tree is not None:
                check_parents(tree, num_new, f"parents[{index}]")
        total_needed = sum(self.blocks_needed(seq, seq.length + num_new) for seq, num_new in sequences)
        if total_needed > self.num_free_blocks:
            raise OutOfKVBlocks(f"KV cache: need {total_needed} more blocks, {self.num_free_blocks} free")
        entries = []
        for (sequence, num_new), tree, two_way in zip(sequences, trees, runs, strict=True):
            self.reserve(sequence, sequence.length + num_new)
            entries.append(PlanEntry(sequence.block_ids, sequence.length, num_new, tree, bidirectional, two_way))
        page_table = build_page_table(entries, self.block_size, self.device)
        for sequence, num_new in sequences:
            sequence.length += num_new
        return page_table

    def keep(self, sequence: SequenceKV, positions: Sequence[int]) -> None:
        """Keeps the KV of `positions` (increasing, all below sequence.length) and of every position before the
        first of them, moved down to consecutive positions; forgets the rest (their blocks return to the pool).

        This is how a tree verification keeps its accepted path. Example: length 10, keep [6, 8, 9] -> positions
        0..6 stay where they are, 8 moves to 7 and 9 to 8; the length becomes 9.
        """
        if not positions:
            raise ValueError("keep: no positions given; truncate forgets everything after a length")
        for index, position in enumerate(positions):
            lowest = positions[index - 1] + 1 if index > 0 else 0
            if not lowest <= position < sequence.length:
                raise ValueError(
                    f"keep: positions[{index}] is {position}; positions must increase and lie below the "
                    f"sequence's length {sequence.length}"
                )
        first = positions[0]
        moved = [(target, source) for target, source in enumerate(positions, start=first) if target != source]
        if moved:
            targets = self._slots_of(sequence, [target for target, _ in moved])
            sources = self._slots_of(sequence, [source for _, source in moved])
            # Gathered before written: a source of one row may be the target of another.
            self.keys[:, targets] = self.keys[:, sources]
            self.values[:, targets] = self.values[:, sources]
        self.truncate(sequence, first + len(positions))

    def _slots_of(self, sequence: SequenceKV, positions: Sequence[int]) -> torch.Tensor:  # -> [len(positions)]
        """The pool slots of `positions`, on the cache's device."""
        slots = [sequence.block_ids[p // self.block_size] * self.block_size + p % self.block_size for p in positions]
        return torch.tensor(slots, dtype=torch.long, device=self.device)
