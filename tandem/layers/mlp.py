"""Gated MLP (SwiGLU, or GeGLU for Gemma) with gate and up projections packed into one matmul."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import PackedLinear

# Hugging Face `hidden_act` / `hidden_activation` names -> the function applied to the gate.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = ACTIVATIONS[activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return self.down_proj(self.activation(gate) * up)
