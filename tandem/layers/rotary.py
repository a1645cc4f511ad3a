"""Rotary position embedding with the default, linear, llama3, YaRN and proportional frequency rules.

Two layouts of the rotated dimensions, as transformers has them:
- rotate-half (Llama): dimension i is paired with dimension i + head_dim / 2;
- interleaved (DeepSeek's checkpoints, `rope_interleave`): dimension 2i is paired with 2i + 1. The output is written
  in the rotate-half layout (pair i -> dimensions i and i + head_dim / 2), as transformers does: queries and keys
  go through the same permutation, so their dot products are unchanged.
"""

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
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, rope).float()
    if rope.rope_type == "proportional":
        # Gemma 4's full layers: only the first int(factor * head_dim / 2) pairs turn, with the exponents of the whole
        # head; the other pairs get frequency 0, a rotation by 0. Example: head_dim 8, factor 0.5 -> pairs 0 and 1
        # turn at theta^0 and theta^(-2/8), pairs 2 and 3 stand still.
        turning = int(rope.partial_rotary_factor * head_dim // 2)
        return (torch.cat((inv_freq[:turning], torch.zeros_like(inv_freq[turning:]))) / rope.factor).float()
    return inv_freq.float()


def _yarn_inverse_frequencies(
    inv_freq: torch.Tensor,  # [head_dim // 2] unscaled
    head_dim: int,
    rope: RopeConfig,
) -> torch.Tensor:  # -> [head_dim // 2]
    """YaRN: frequencies that turn more than beta_fast times over the original context are kept, those that turn
    fewer than beta_slow times are slowed down by `factor`, and a linear ramp over the pair index blends the two.

    Example (DeepSeek-V3's beta_fast 32, beta_slow 1, original context 4096, theta 10000) with head_dim 8: the bounds
    are pairs 1.31 -> 1 and 2.81 -> 3 (rounded outwards), so pairs 0 and 1 are kept, pair 3 is slowed down and
    pair 2 is half of each.
    """

    def pair_index(rotations: float) -> float:  # the (fractional) pair that turns `rotations` times
        wavelengths = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = pair_index(rope.beta_fast), pair_index(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero, as transformers does
    pairs = torch.arange(head_dim // 2, dtype=torch.float64, device=inv_freq.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: kept, 1: slowed down
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The scale YaRN puts on cos and sin (1 for the other rules), derived as transformers does."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor, 1.0)


def yarn_softmax_mscale(rope: RopeConfig) -> float:
    """The factor DeepSeek-V3 multiplies its softmax scale by: mscale(factor, mscale_all_dim) squared, when the rope
    is scaled and mscale_all_dim is set. It is YaRN's attention temperature applied to the whole head, no-rope part
    included; with mscale == mscale_all_dim (DeepSeek-V3, Kimi-K2) the cos/sin scale is 1 and this is the only one."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, interleaved: bool = False) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it is derived from the config, never loaded or re-initialised.
        self.inv_freq = inverse_frequencies(head_dim, rope)  # [head_dim // 2]
        self.attention_factor = rope_attention_factor(rope)
        self.interleaved = interleaved
        # Every layer of a forward pass rotates at the same positions (one tensor, the step's): cos and sin are
        # computed by the first layer and reused by the others. Keyed by the tensor object, not its contents: a
        # forward over reused buffers passes a new tensor object each time (tandem.layers.cuda_graphs).
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate(
        self,
        positions: torch.Tensor,  # [num_tokens]
        heads: torch.Tensor,  # [num_tokens, any number of heads, head_dim]
    ) -> torch.Tensor:  # -> the same shape
        """Rotates every head of each token by its position. Queries and keys that sit side by side in one tensor
        (the q/k part of a packed projection) go through one call, which is fewer operations than two.

        Heads wider than this embedding's dimensions (partial rotary: built with head_dim * partial_rotary_factor,
        Step-3.5) have their first dimensions rotated and the rest passed through unchanged."""
        rotary_dim = 2 * self.inv_freq.shape[0]
        if heads.shape[-1] > rotary_dim:
            rotated = self.rotate(positions, heads[..., :rotary_dim])
            return torch.cat((rotated, heads[..., rotary_dim:]), dim=-1)
        cos, sin = self._cos_sin(positions)
        if self.interleaved:
            return rotate_interleaved(heads, cos, sin)
        return _rotate(heads, cos, sin)

    def _cos_sin(
        self, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> [num_tokens, 1, head_dim] each (head_dim // 2 interleaved)
        """cos and sin of every rotated dimension; for rotate-half the sin carries the sign of the dimension's pair
        partner (negative in the first half), so that a rotation is x * cos + roll(x, head_dim / 2) * sin."""
        if self._last is not None and self._last[0] is positions:
            return self._last[1], self._last[2]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        if not self.interleaved:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        self._last = (positions, cos, sin)
        return cos, sin


def _rotate(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim], negative in the first half
) -> torch.Tensor:
    # Dimension i < half becomes x_i cos - x_{i+half} sin and dimension i + half becomes x_{i+half} cos + x_i sin:
    # rolling by half brings each dimension's partner to it, and the signed sin gives the minus.
    half = x.shape[-1] // 2
    if x.dtype == torch.float32:
        return x * cos + x.roll(half, dims=-1) * signed_sin
    wide = x.float()
    return (wide * cos + wide.roll(half, dims=-1) * signed_sin).to(x.dtype)


def rotate_interleaved(
    x: torch.Tensor,  # [num_tokens, heads, head_dim], pairs (0, 1), (2, 3), ...
    cos: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim // 2]
) -> torch.Tensor:  # -> [num_tokens, heads, head_dim] in the rotate-half layout (see the module docstring)
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1).to(x.dtype)
