"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama style: weight * normed, with normed cast back to the input dtype before the multiply.

    With `unit_offset` (Gemma style) the scale is (1 + weight), checkpoints store weight centred on 0, and the
    multiply happens in float32 before the cast back, as transformers' Gemma norms do. `float32_scale` keeps the
    plain weight * normed but multiplies in float32 before the cast back too (Gemma 4's norms).
    """

    def __init__(self, size: int, eps: float, unit_offset: bool = False, float32_scale: bool = False) -> None:
        super().__init__()
        # Either way the norm starts as a plain normalisation (scale 1).
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_scale = float32_scale

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        dtype = hidden.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32 and not self.unit_offset:
            # Already float32: the same normalisation as below, in one operation instead of nine.
            return F.rms_norm(hidden, self.weight.shape, self.weight, self.eps)
        hidden = hidden.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (hidden * (1.0 + self.weight.float())).to(dtype)
        if self.float32_scale:
            return (hidden * self.weight.float()).to(dtype)
        return self.weight * hidden.to(dtype)
