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
    """

    def __init__(
        self, input_size: int, parts: dict[str, int], bias: bool, group: ParallelGroup = SINGLE_PROCESS
    ) -> None:
        local_parts = {name: group.split(size, f"the {name} rows") for name, size in parts.items()}
        super().__init__(input_size, sum(local_parts.values()), bias=bias)
        self.group = group
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
        if destination.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(destination.shape)}, got {tuple(tensor.shape)}")
        destination.copy_(tensor)

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        assert part is not None, "every parameter of a PackedLinear is loaded part by part"
        _, size = self.part_rows[part]
        full_rows = size * self.group.world_size
        full_shape = (full_rows, self.in_features) if parameter_name == "weight" else (full_rows,)
        return ShardSpec(full_shape, dim=0, start=self.group.rank * size, size=size)
