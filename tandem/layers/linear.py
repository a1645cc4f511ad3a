"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) into one matmul, column parallel."""

from __future__ import annotations

import torch

from tandem.layers.matmul import Linear
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ShardSpec


class PackedLinear(Linear):
    """A Linear whose output rows are the concatenation of named parts, loaded part by part.

    Example: q/k/v with sizes {"q": 64, "k": 32, "v": 32} -> rows 0..63 are q, 64..95 k, 96..127 v.

    Column parallel: with tp ranks, each part is split evenly and each rank packs its slice of every part, so the
    output stays split across ranks with no communication. In the example at tp 2, rank 1 holds checkpoint rows
    q 32..63, k 16..31 and v 16..31 as its rows 0..31, 32..47 and 48..63.

    With `experts` > 1 every part is a stack of that many matrices, stored in the checkpoint as one tensor
    [experts, rows, input] (Step-3.5's `moe.gate_proj.weight`); a part's rows are its experts' rows one after
    another, and each rank holds its slice of every expert's rows. Example: {"gate": 4, "up": 4} with 2 experts at
    tp 2: rank 1 holds rows 2..3 of each expert, as its rows gate (e0, e1) 0..3, up (e0, e1) 4..7. `expert_rows`
    gives one expert's rows of one part.
    """

    def __init__(
        self,
        input_size: int,
        parts: dict[str, int],  # part -> rows (of one expert, with experts > 1)
        bias: bool,
        group: ParallelGroup = SINGLE_PROCESS,
        experts: int = 1,
    ) -> None:
        assert experts == 1 or not bias, "stacked expert projections have no bias"
        local_parts = {name: experts * group.split(size, f"the {name} rows") for name, size in parts.items()}
        super().__init__(input_size, sum(local_parts.values()), bias=bias)
        self.group = group
        self.experts = experts
        self.prepackable = experts == 1  # a stack is multiplied one expert's rows at a time (`expert_rows`)
        self.part_rows: dict[str, tuple[int, int]] = {}  # part -> (first local row, local rows)
        offset = 0
        for name, size in local_parts.items():
            self.part_rows[name] = (offset, size)
            offset += size

    def load_part(self, parameter_name: str, part: str, tensor: torch.Tensor) -> None:
        """Copies this rank's slice of one checkpoint tensor (weight or bias of one part) into its rows."""
        parameter: torch.Tensor = getattr(self, parameter_name)
        start, size = self.part_rows[part]
        destination = parameter.data.narrow(0, start, size)
        if self.experts > 1:
            destination = destination.view(self.experts, size // self.experts, *destination.shape[1:])
        if destination.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(destination.shape)}, got {tuple(tensor.shape)}")
        destination.copy_(tensor)

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        assert part is not None, "every parameter of a PackedLinear is loaded part by part"
        _, size = self.part_rows[part]
        if self.experts > 1:  # [experts, rows, input]: this rank's rows of every expert
            rows = size // self.experts
            full_shape: tuple[int, ...] = (self.experts, rows * self.group.world_size, self.in_features)
            return ShardSpec(full_shape, dim=1, start=self.group.rank * rows, size=rows)
        full_rows = size * self.group.world_size
        full_shape = (full_rows, self.in_features) if parameter_name == "weight" else (full_rows,)
        return ShardSpec(full_shape, dim=0, start=self.group.rank * size, size=size)

    def expert_rows(self, part: str, expert: int) -> torch.Tensor:  # -> [this rank's rows of one expert, input]
        if self.stored is not None:  # kept as stored: only this expert's rows expand
            return self.stored.expert(part, expert)
        start, size = self.part_rows[part]
        rows = size // self.experts
        return self.weight.narrow(0, start + expert * rows, rows)
