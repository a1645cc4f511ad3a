"""Rotary position embedding (rotate-half layout) with the default, linear and llama3 frequency rules."""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:  # -> [head_dim // 2]
    # Always computed on the CPU (explicit device), also when the model is built on the meta device.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).float()
    if rope.rope_type == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, and the band between
        # the two wavelength bounds is interpolated smoothly (Llama 3.1 rule).
        old_context = rope.original_max_position_embeddings
        low_freq_wavelength = old_context / rope.low_freq_factor
        high_freq_wavelength = old_context / rope.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
        return torch.where(is_medium, smoothed, scaled).float()
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it is derived from the config, never loaded or re-initialised.
        self.inv_freq = inverse_frequencies(head_dim, rope)  # [head_dim // 2]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        cos, sin = angles.cos(), angles.sin()
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated_half.float() * sin).to(x.dtype)
