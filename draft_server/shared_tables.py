"""Pulling the target's shared tables (embedding, LM head) over its GetWeights stream.

The target sends each table as its tensor-parallel shards (tandem.parallel.vocab): shard r of a tp-N target holds
rows [r * s, (r + 1) * s) of the vocabulary padded by the vocab-parallel rule, each shard one checksummed tensor of
the stream. The draft checks that every shard arrived once, with the shape the rule gives, then reassembles the
table, or cuts it again for its own tp (`SharedTable.shards_for`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.parallel.vocab import assemble_shards, reshard, shard_rows
from tandem.wire import target_pb2, target_pb2_grpc
from tandem.wire.codec import AssembledTensor, WeightAssembler

LOG = logging.getLogger(__name__)


class SharedTableError(ValueError):
    """Shards that do not make up one table; the message says which shard and what was expected."""


@dataclass(frozen=True)
class SharedTable:
    name: str
    vocab_size: int
    shards: tuple[torch.Tensor, ...]  # the target's tp shards in rank order, each [s, hidden] with padding rows

    def full(self) -> torch.Tensor:  # -> [vocab, hidden]
        return assemble_shards(self.shards, self.vocab_size)

    def shards_for(self, tp: int) -> list[torch.Tensor]:  # -> tp tensors [s', hidden]
        """The table cut by the vocab-parallel rule for a consumer running with another tp."""
        if tp == len(self.shards):
            return list(self.shards)
        return reshard(self.shards, self.vocab_size, tp)


def collect_table(name: str, pieces: Sequence[AssembledTensor]) -> SharedTable:
    """Checks the received shards of one table and orders them by rank."""
    if not pieces:
        raise SharedTableError(f"{name}: the target sent no shard")
    num_shards = pieces[0].shard.num_shards
    vocab_size = pieces[0].shard.vocab_size
    by_rank: dict[int, torch.Tensor] = {}
    for piece in pieces:
        if (piece.shard.num_shards, piece.shard.vocab_size) != (num_shards, vocab_size):
            raise SharedTableError(
                f"{name}: shard {piece.shard.rank} says {piece.shard.num_shards} shards of a vocabulary of "
                f"{piece.shard.vocab_size}, shard {pieces[0].shard.rank} said {num_shards} of {vocab_size}"
            )
        if piece.shard.rank in by_rank:
            raise SharedTableError(f"{name}: shard {piece.shard.rank} arrived twice")
        if not 0 <= piece.shard.rank < num_shards:
            raise SharedTableError(f"{name}: shard rank {piece.shard.rank} is outside 0..{num_shards - 1}")
        by_rank[piece.shard.rank] = piece.tensor
    missing = [rank for rank in range(num_shards) if rank not in by_rank]
    if missing:
        raise SharedTableError(f"{name}: shards {missing} of {num_shards} never arrived")
    rows = shard_rows(vocab_size, num_shards)
    width = by_rank[0].shape[1:]
    for rank, shard in sorted(by_rank.items()):
        if shard.shape[0] != rows or shard.shape[1:] != width:
            raise SharedTableError(
                f"{name}: shard {rank} has shape {list(shard.shape)}; a vocabulary of {vocab_size} in "
                f"{num_shards} shards gives [{rows}, {', '.join(map(str, width))}]"
            )
    return SharedTable(name, vocab_size, tuple(by_rank[rank] for rank in range(num_shards)))


async def pull_tables(
    target: target_pb2_grpc.TargetStub, names: Sequence[str], chunk_bytes: int = 0
) -> dict[str, SharedTable]:
    """Streams the named tables from the target (chunk_bytes 0: the target's default chunk size), logging progress
    every quarter of each shard."""
    reported: dict[str, int] = {}

    def progress(label: str, received: int, total: int) -> None:
        quarter = 4 * received // max(total, 1)
        if reported.get(label) != quarter:
            reported[label] = quarter
            LOG.info("pulling %s from the target: %d / %d bytes", label, received, total)

    assembler = WeightAssembler(progress=progress)
    pieces: dict[str, list[AssembledTensor]] = {name: [] for name in names}
    async for chunk in target.GetWeights(target_pb2.WeightsRequest(names=list(names), chunk_bytes=chunk_bytes)):
        completed = assembler.add(chunk)
        if completed is not None:
            if completed.name not in pieces:
                raise SharedTableError(f"the target sent {completed.name!r}, which was not asked for")
            pieces[completed.name].append(completed)
    assembler.finish()
    tables = {name: collect_table(name, received) for name, received in pieces.items()}
    for table in tables.values():
        LOG.info(
            "%s: %d rows reassembled from %d shard(s) of %d rows",
            table.name,
            table.vocab_size,
            len(table.shards),
            table.shards[0].shape[0],
        )
    return tables
