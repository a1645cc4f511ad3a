"""Gated MLP (SwiGLU, or GeGLU for Gemma) with gate and up projections packed into one matmul.

Optional clamp (Step-3.5's `swiglu_limits`): with limit L the activated gate is capped at L from above and the up
projection clipped to [-L, L] before they multiply: down(min(act(gate), L) * clip(up, -L, L)).

Tensor parallel: gate/up is column parallel (each rank computes intermediate_size / tp units) and down_proj row
parallel (its all-reduce sums the ranks' contributions).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import PackedLinear
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import RowParallelLinear

# Hugging Face `hidden_act` / `hidden_activation` names -> the function applied to the gate.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        group: ParallelGroup = SINGLE_PROCESS,
        limit: float | None = None,  # the clamp above; None: none
        reduce: bool = True,  # False: each rank returns its partial sum (RowParallelLinear's reduce)
        what: str = "intermediate_size",  # the config field of the units, named when tp does not divide them
    ) -> None:
        super().__init__()
        group.split(intermediate_size, what)  # refuses an uneven split, naming the config field
        parts = {"gate": intermediate_size, "up": intermediate_size}
        self.gate_up_proj = PackedLinear(hidden_size, parts, bias=False, group=group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, group=group, reduce=reduce)
        self.activation = ACTIVATIONS[activation]
        self.limit = limit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(gated_product(self.activation(gate), up, self.limit))


def gated_product(
    activated: torch.Tensor,  # [num_tokens, units] act(gate)
    up: torch.Tensor,  # [num_tokens, units]
    limit: float | None,
) -> torch.Tensor:  # -> [num_tokens, units]
    """act(gate) * up, clamped by `limit` as the module docstring says."""
    if limit is None:
        return activated * up
    return activated.clamp(max=limit) * up.clamp(min=-limit, max=limit)
