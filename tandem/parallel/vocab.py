"""Which vocabulary rows each tensor-parallel rank holds: SGLang's vocab-parallel rule (REFERENCE.md).

The vocabulary V is padded to a multiple of 64, or of 64 * tp when tp does not divide that, and split into tp equal
shards of s = V_padded / tp rows: rank r holds rows [r * s, (r + 1) * s). Rows at or past V are padding (zero).

Worked example, V = 50257 (GPT-2), tp = 2: 50257 rounds up to 50304 = 786 * 64, which 2 divides, so V_padded = 50304
and s = 25152. Rank 0 holds rows 0..25151; rank 1 holds rows 25152..50303, of which 25152..50256 are real (25105) and
the last 47 are padding. A plain split of the unpadded table (ceil(50257 / 2) = 25129 rows) would put token 25129 at
row 0 of rank 1 instead of row 25129 of rank 0: a draft that reassembles shards by one rule from a target that cut
them by the other reads wrong rows. For V a multiple of 64 * tp (32000, 128256, 151936 at tp 2/4/8) the two agree.

When tp does not divide the 64-padded size, e.g. V = 1000, tp = 3: 1024 is not a multiple of 3, so V pads to a
multiple of 64 * 3 = 192, V_padded = 1152, s = 384.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

VOCAB_PADDING = 64


def padded_vocab(vocab_size: int, tp: int) -> int:
    padded = _round_up(vocab_size, VOCAB_PADDING)
    return padded if padded % tp == 0 else _round_up(vocab_size, VOCAB_PADDING * tp)


def shard_rows(vocab_size: int, tp: int) -> int:
    """s: the rows of every rank's shard, padding included."""
    return padded_vocab(vocab_size, tp) // tp


@dataclass(frozen=True)
class VocabShard:
    """Rank `rank`'s rows of the vocabulary: [start, start + rows), of which the first `real` are below V."""

    start: int
    rows: int  # s, the same on every rank
    real: int  # rows below V; the remaining rows - real are padding

    @property
    def padding(self) -> int:
        return self.rows - self.real


def vocab_shard(vocab_size: int, tp: int, rank: int) -> VocabShard:
    """Example: V = 333, tp = 8 pads to 384, s = 48; rank 6 holds rows 288..335 (45 real), rank 7 only padding."""
    rows = shard_rows(vocab_size, tp)
    start = rank * rows
    return VocabShard(start=start, rows=rows, real=max(0, min(rows, vocab_size - start)))


def shard_table(
    table: torch.Tensor,  # [vocab, hidden] the whole table
    tp: int,
    rank: int,
) -> torch.Tensor:  # -> [s, hidden], zero rows for padding
    shard = vocab_shard(table.shape[0], tp, rank)
    rows = table.new_zeros((shard.rows, *table.shape[1:]))
    rows[: shard.real] = table[shard.start : shard.start + shard.real]
    return rows


def assemble_shards(
    shards: Sequence[torch.Tensor],  # tp tensors [s, hidden], in rank order
    vocab_size: int,
) -> torch.Tensor:  # -> [vocab, hidden]
    """The inverse of shard_table: concatenates the shards and drops the padding rows."""
    expected = shard_rows(vocab_size, len(shards))
    for rank, shard in enumerate(shards):
        if shard.shape[0] != expected:
            raise ValueError(
                f"shard {rank} has {shard.shape[0]} rows; vocab {vocab_size} at tp {len(shards)} gives {expected}"
            )
    return torch.cat(list(shards))[:vocab_size]


def reshard(
    shards: Sequence[torch.Tensor],  # tp tensors [s, hidden], in rank order
    vocab_size: int,
    new_tp: int,
) -> list[torch.Tensor]:  # -> new_tp tensors [s', hidden]
    """The same table cut for another tp, e.g. a tp-2 target's shards for a tp-1 draft."""
    table = assemble_shards(shards, vocab_size)
    return [shard_table(table, new_tp, rank) for rank in range(new_tp)]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
