"""Linear layers whose weight packs several checkpoint tensors (q/k/v, gate/up) into one matmul."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """A Linear whose output rows are the concatenation of named parts, loaded part by part.

    Example: q/k/v with sizes {"q": 64, "k": 32, "v": 32} -> rows 0..63 are q, 64..95 k, 96..127 v.
    """

    def __init__(self, input_size: int, parts: dict[str, int], bias: bool) -> None:
        super().__init__(input_size, sum(parts.values()), bias=bias)
        self.part_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in parts.items():
            self.part_rows[name] = (offset, size)
            offset += size

    def load_part(self, parameter_name: str, part: str, tensor: torch.Tensor) -> None:
        """Copies one checkpoint tensor (weight or bias of one part) into its rows."""
        parameter: torch.Tensor = getattr(self, parameter_name)
        start, size = self.part_rows[part]
        destination = parameter.data.narrow(0, start, size)
        if destination.shape != tensor.shape:
            raise ValueError(f"expected shape {tuple(destination.shape)}, got {tuple(tensor.shape)}")
        destination.copy_(tensor)
