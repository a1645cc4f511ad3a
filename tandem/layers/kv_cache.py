"""Paged KV cache: fixed-size blocks from one preallocated pool, a block table per sequence.

A position p of a sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size`
of the flat pool. Example with block_size 4 and block_ids [7, 2]: position 5 -> block 2, offset 1
-> slot 9. Rolling back rejected draft tokens is a `truncate`; finished requests `release` their blocks.

What a slot holds is the model's `CacheLayout`: a key row and a value row per KV head (multi-head attention), or
one compressed row and no values (MLA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.settings import KVCacheSettings


class OutOfKVBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


@dataclass
class SequenceKV:
    block_ids: list[int] = field(default_factory=list)
    length: int = 0  # positions [0, length) hold valid KV


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


@dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a packed forward pass.

    Its query tokens are rows [query_start, query_start + query_len) of the packed batch and sit at
    positions [context_len - query_len, context_len); they attend to KV positions [0, context_len).
    """

    query_start: int
    query_len: int
    context_len: int
    context_slots: torch.Tensor  # [context_len] pool slot of every visible position


@dataclass(frozen=True)
class AttentionMetadata:
    spans: tuple[SequenceSpan, ...]
    write_slots: torch.Tensor  # [num_tokens] pool slot where each new token's KV is written
    positions: torch.Tensor  # [num_tokens]


class PagedKVCache:
    @classmethod
    def for_layout(
        cls, num_layers: int, layout: CacheLayout, settings: KVCacheSettings, dtype: torch.dtype, device: torch.device
    ) -> PagedKVCache:
        """The pool `settings` asks for, shaped by what one token leaves in one layer (`layout`)."""
        return cls(
            num_layers,
            settings.num_blocks,
            settings.block_size,
            layout.num_kv_heads,
            layout.key_dim,
            dtype,
            device,
            value_dim=layout.value_dim,
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
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        num_slots = num_blocks * block_size
        value_width = head_dim if value_dim is None else value_dim
        # [layers, slots, kv_heads, head_dim] and [layers, slots, kv_heads, value_width]
        self.keys = torch.zeros((num_layers, num_slots, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros((num_layers, num_slots, num_kv_heads, value_width), dtype=dtype, device=device)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self.device = torch.device(device)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_needed(self, sequence: SequenceKV, length: int) -> int:
        return max(0, -(-length // self.block_size) - len(sequence.block_ids))

    def reserve(self, sequence: SequenceKV, length: int) -> None:
        """Makes room for positions [0, length); raises OutOfKVBlocks and changes nothing if the pool is short."""
        needed = self.blocks_needed(sequence, length)
        if needed > len(self._free_blocks):
            raise OutOfKVBlocks(f"KV cache: need {needed} more blocks, {len(self._free_blocks)} free")
        for _ in range(needed):
            sequence.block_ids.append(self._free_blocks.pop())

    def truncate(self, sequence: SequenceKV, length: int) -> None:
        """Forgets positions >= length and returns blocks that no longer hold any valid position."""
        sequence.length = min(sequence.length, length)
        keep = -(-sequence.length // self.block_size)
        self._free_blocks.extend(reversed(sequence.block_ids[keep:]))
        del sequence.block_ids[keep:]

    def release(self, sequence: SequenceKV) -> None:
        self.truncate(sequence, 0)

    def slots(self, sequence: SequenceKV, start: int, end: int) -> torch.Tensor:  # -> [end - start]
        positions = torch.arange(start, end)
        table = torch.tensor(sequence.block_ids, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def plan(self, sequences: list[tuple[SequenceKV, int]]) -> AttentionMetadata:
        """Plans one packed forward: each (sequence, num_new) appends num_new tokens at sequence.length.

        Reserves blocks for all sequences first (all or nothing), then advances their lengths.
        """
        total_needed = sum(self.blocks_needed(seq, seq.length + num_new) for seq, num_new in sequences)
        if total_needed > len(self._free_blocks):
            raise OutOfKVBlocks(f"KV cache: need {total_needed} more blocks, {len(self._free_blocks)} free")
        spans = []
        write_slots = []
        positions = []
        query_start = 0
        for sequence, num_new in sequences:
            start = sequence.length
            end = start + num_new
            self.reserve(sequence, end)
            context_slots = self.slots(sequence, 0, end)
            spans.append(SequenceSpan(query_start, num_new, end, context_slots))
            write_slots.append(context_slots[start:])
            positions.append(torch.arange(start, end))
            sequence.length = end
            query_start += num_new
        return AttentionMetadata(
            spans=tuple(spans),
            write_slots=torch.cat(write_slots).to(self.device),
            positions=torch.cat(positions).to(self.device),
        )
