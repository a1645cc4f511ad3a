"""Row-parallel linear and vocab-parallel embedding / LM head; the column-parallel linear is PackedLinear.

Megatron's split of a transformer block: the projections that fan out (q/k/v, gate/up) are column parallel, so each
rank computes whole heads and its slice of the MLP's intermediate units with no communication; the projections that
fan back in (o_proj, down_proj) are row parallel, and the one all-reduce per block sits in their forward. The
residual stream, the norms and the rotary tables are replicated on every rank.

Each parallel module says, per parameter, which slice of the checkpoint tensor its rank holds (`ShardSpec`); the
loader reads only that slice from the safetensors file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.matmul import Linear
from tandem.parallel.group import ParallelGroup, all_gather, all_reduce
from tandem.parallel.vocab import VocabShard, vocab_shard


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a checkpoint tensor of shape `full_shape`: indices [start, start + size) along `dim`."""

    full_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    size: int | None = None  # None: the whole extent along dim
    by_vocab: bool = False  # rows cut by the vocab-parallel rule (tandem.parallel.vocab), not in equal slices

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> ShardSpec:
        return cls(full_shape=shape)

    def on_rank(self, rank: int, world_size: int) -> ShardSpec:
        """The slice rank `rank` holds, of a spec made on rank 0: every rank holds an equal slice after the one
        before, but by the vocab-parallel rule (a last rank may hold fewer real rows, or none)."""
        if self.size is None:
            return self
        if self.by_vocab:
            shard = vocab_shard(self.full_shape[self.dim], world_size, rank)
            return replace(self, start=shard.start, size=shard.real)
        return replace(self, start=rank * self.size)


@runtime_checkable
class ShardedModule(Protocol):
    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        """What of the checkpoint tensor loads into parameter `parameter_name` (of packed part `part`)."""
        ...


class ColumnParallelLinear(Linear):
    """y = x W^T + b with W's output rows (and the bias) split across ranks: rank r computes rows [r * out / tp,
    (r + 1) * out / tp) of y, with no communication. A one-part PackedLinear under the checkpoint's own name (MLA's
    q_b_proj and kv_b_proj, whose rows are heads)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, group: ParallelGroup, what: str) -> None:
        local_output_size = group.split(output_size, what)
        super().__init__(input_size, local_output_size, bias=bias)
        self.group = group
        self.output_size = output_size

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        full_shape = (self.output_size,) if parameter_name == "bias" else (self.output_size, self.in_features)
        return ShardSpec(full_shape, dim=0, start=self.group.rank * self.out_features, size=self.out_features)


class RowParallelLinear(Linear):
    """y = x W^T + b with W's input columns split across ranks; the partial products are summed by an all-reduce.

    Rank r holds columns [r * in / tp, (r + 1) * in / tp) of W, which is what its column-parallel input provides.
    The bias is replicated and added by rank 0 alone, before the sum, so that it counts once; at tp 1 this is
    exactly nn.Linear. Without `reduce` the rank's partial product is returned, for a caller that sums several
    (a mixture of experts: one all-reduce for every expert of a layer).
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool, group: ParallelGroup, reduce: bool = True
    ) -> None:
        local_input_size = group.split(input_size, "the row-parallel input width")
        super().__init__(local_input_size, output_size, bias=bias)
        self.group = group
        self.input_size = input_size
        self.local_input_size = local_input_size
        self.reduce = reduce

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., input / tp] -> [..., output]
        partial = self.product(hidden, self.bias if self.group.is_first else None)
        return all_reduce(partial, self.group) if self.reduce else partial

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        if parameter_name == "bias":
            return ShardSpec.whole((self.out_features,))
        full_shape = (self.out_features, self.input_size)
        return ShardSpec(full_shape, dim=1, start=self.group.rank * self.local_input_size, size=self.local_input_size)


class VocabParallelEmbedding(nn.Embedding):
    """Embedding whose rows are split by the vocab-parallel rule (tandem.parallel.vocab).

    Each rank looks up the ids that fall in its rows, writes zeros for the others, and the all-reduce adds the
    ranks' rows together: every id is found on exactly one rank. Only the real rows are stored (`weight` is
    [shard.real, hidden]): padding rows are zero by definition and no id reaches them, and at tp 1 the table is
    then exactly the checkpoint's. `padded_weight` gives the shard as the rule defines it, padding included.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup) -> None:
        shard = vocab_shard(vocab_size, group.world_size, group.rank)
        super().__init__(shard.real, hidden_size)
        self.group = group
        self.vocab_size = vocab_size
        self.shard: VocabShard = shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        local_ids = input_ids - self.shard.start
        mine = (local_ids >= 0) & (local_ids < self.shard.real)  # [...]
        if self.shard.real == 0:  # a rank holding only padding rows (tiny vocabularies at large tp)
            embedded = self.weight.new_zeros((*input_ids.shape, self.weight.shape[1]))
        else:
            embedded = F.embedding(torch.where(mine, local_ids, 0), self.weight)
            embedded = embedded.masked_fill(~mine[..., None], 0.0)
        return all_reduce(embedded, self.group)

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        return _vocab_spec(self.vocab_size, self.embedding_dim, self.shard)

    def padded_weight(self) -> torch.Tensor:  # -> [s, hidden], zero rows for padding
        return F.pad(self.weight.detach(), (0, 0, 0, self.shard.padding))


class ParallelLMHead(Linear):
    """LM head whose vocabulary rows are split like VocabParallelEmbedding's (and may be the same tensor, tied).

    Each rank computes the logits of its rows; the all-gather assembles them on every rank (rank 0 uses them, the
    others drop them), and the padding columns are cut off.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup) -> None:
        shard = vocab_shard(vocab_size, group.world_size, group.rank)
        super().__init__(hidden_size, shard.real, bias=False)
        self.group = group
        self.vocab_size = vocab_size
        self.shard: VocabShard = shard

    def forward(self, normed: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., vocab]
        local = F.pad(self.product(normed, None), (0, self.shard.padding))  # [..., s]
        return all_gather(local, self.group, dim=-1)[..., : self.vocab_size]  # [..., tp * s] -> [..., vocab]

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        return _vocab_spec(self.vocab_size, self.in_features, self.shard)

    def padded_weight(self) -> torch.Tensor:  # -> [s, hidden], zero rows for padding; a stored head expanded
        return F.pad(self.float_weight().detach(), (0, 0, 0, self.shard.padding))


def _vocab_spec(vocab_size: int, width: int, shard: VocabShard) -> ShardSpec:
    return ShardSpec((vocab_size, width), dim=0, start=shard.start, size=shard.real, by_vocab=True)
