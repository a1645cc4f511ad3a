"""Gemma 4's image encoder, as its multimodal checkpoints ship it: the vision tower and the multimodal embedder.

Gemma 4 reads an image at a variable resolution. Its image processor (tandem.models.gemma4_image_tokens says how
large) resizes the image, keeping its aspect ratio, to the largest grid of `patch_size` patches whose sides are
multiples of `pooling_kernel_size` patches and whose patch count fits the soft-token budget, and hands each patch as
one row of pixels in [0, 1] with its (x, y) place on the grid. The tower maps the pixels to [-1, 1] and projects each
patch (`input_proj`, no bias), adding a learned embedding of its column and one of its row; then the encoder layers
(RMSNorm, bidirectional attention over all the image's patches, RMSNorm, residual; RMSNorm, a gated GELU MLP,
RMSNorm, residual). The attention normalizes q and k per head (with weights) and v (without), turns the first half of
each head by the patch's column and the second half by its row (rotate-half rope over head_dim / 2 each, the same
frequencies on both axes), and does not scale the scores. The pooler averages each `pooling_kernel_size` square of
patches into one soft token, row by row, and multiplies by sqrt(vision hidden); with `standardize` a learned bias is
subtracted and a learned scale applied. The embedder RMS-normalizes each soft token (no weight) and projects it to the
text hidden size: one embedding per image placeholder token. With `use_clipped_linears` every linear of the encoder
layers clamps its input and its output to bounds stored in the checkpoint.

Checkpoint names: `model.vision_tower.*` and `model.embed_vision.*` (the hub files and transformers' save of
Gemma4ForConditionalGeneration), or without `model.` (a save of Gemma4Model). Checked against transformers'
`Gemma4Model.get_image_features` (tests/unit/test_gemma4_vision.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.mlp import ACTIVATIONS
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ConfigError, RopeConfig
from tandem.models.gemma4_layers import rms_normalize
from tandem.weights.loader import NameMap, loaded_module

NAMES = NameMap(
    renames=(("model.vision_tower.", "vision_tower."), ("model.embed_vision.", "embed_vision.")),
    packed={},  # q/k/v and gate/up are Linears of their own here, as in the checkpoint
)
READ = ("vision_tower.", "embed_vision.", "model.vision_tower.", "model.embed_vision.")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    activation: str
    rope_theta: float
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int  # rows of each axis' position table: the widest grid side the tower reads
    clipped_linears: bool
    standardize: bool
    text_hidden_size: int

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> VisionConfig:
        """A Gemma 4 multimodal config.json's vision_config and text hidden size (transformers' Gemma4VisionConfig
        defaults where the file leaves a field out)."""
        vision, text = hf.get("vision_config"), hf.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ConfigError("vision_config and text_config: a Gemma 4 multimodal config.json has both")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config.rope_parameters.rope_type: {rope['rope_type']!r} is not 'axial'")
        config = VisionConfig(
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 3072),
            num_layers=vision.get("num_hidden_layers", 16),
            num_heads=vision.get("num_attention_heads", 12),
            num_kv_heads=vision.get("num_key_value_heads", 12),
            head_dim=vision.get("head_dim", 64),
            eps=vision.get("rms_norm_eps", 1e-6),
            activation=vision.get("hidden_activation", "gelu_pytorch_tanh"),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            patch_size=vision.get("patch_size", 16),
            pooling_kernel_size=vision.get("pooling_kernel_size", 3),
            position_embedding_size=vision.get("position_embedding_size", 10_240),
            clipped_linears=vision.get("use_clipped_linears", False),
            standardize=vision.get("standardize", False),
            text_hidden_size=text["hidden_size"],
        )
        if config.head_dim % 4:
            raise ConfigError(
                f"vision_config.head_dim: {config.head_dim} is not a multiple of 4 (each half of a head turns by one "
                "axis of the patch grid, in pairs)"
            )
        if config.activation not in ACTIVATIONS:
            raise ConfigError(
                f"vision_config.hidden_activation: {config.activation!r} is not one of {list(ACTIVATIONS)}"
            )
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(
                f"vision_config.num_key_value_heads: {config.num_kv_heads} does not divide the "
                f"{config.num_heads} attention heads"
            )
        return config


class ClippableLinear(nn.Module):
    """A Linear without bias whose input and output are clamped to stored bounds when the config clips them."""

    input_min: torch.Tensor  # [] each, buffers of a clipped one
    input_max: torch.Tensor
    output_min: torch.Tensor
    output_max: torch.Tensor

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:  # scalars from the checkpoint
            for bound in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(bound, torch.empty(()))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        if not self.clipped:
            return self.linear(hidden)
        hidden = torch.clamp(hidden, self.input_min, self.input_max)
        return torch.clamp(self.linear(hidden), self.output_min, self.output_max)


@dataclass(frozen=True)
class AxisRotation:
    """One axis of the patch grid: its rotary embedding and each patch's coordinate on it."""

    rotary: RotaryEmbedding
    positions: torch.Tensor  # [patches]


def _turned(
    heads: torch.Tensor,  # [patches, heads, head_dim]
    axes: tuple[AxisRotation, AxisRotation],
) -> torch.Tensor:  # -> the same shape
    """The first half of each head turned by the patch's column, the second half by its row."""
    columns, rows = axes
    half = heads.shape[-1] // 2
    return torch.cat(
        (
            columns.rotary.rotate(columns.positions, heads[..., :half]),
            rows.rotary.rotate(rows.positions, heads[..., half:]),
        ),
        dim=-1,
    )


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size, head_dim, clipped = config.hidden_size, config.head_dim, config.clipped_linears
        self.head_dim, self.eps = head_dim, config.eps
        self.q_proj = ClippableLinear(size, config.num_heads * head_dim, clipped)
        self.k_proj = ClippableLinear(size, config.num_kv_heads * head_dim, clipped)
        self.v_proj = ClippableLinear(size, config.num_kv_heads * head_dim, clipped)
        self.o_proj = ClippableLinear(config.num_heads * head_dim, size, clipped)
        self.q_norm = RMSNorm(head_dim, config.eps, float32_scale=True)
        self.k_norm = RMSNorm(head_dim, config.eps, float32_scale=True)

    def forward(
        self,
        hidden: torch.Tensor,  # [patches, hidden]
        axes: tuple[AxisRotation, AxisRotation],  # the turns by the patches' columns and by their rows
    ) -> torch.Tensor:  # -> [patches, hidden]
        patches = hidden.shape[0]
        query = _turned(self.q_norm(self.q_proj(hidden).view(patches, -1, self.head_dim)), axes)
        key = _turned(self.k_norm(self.k_proj(hidden).view(patches, -1, self.head_dim)), axes)
        value = rms_normalize(self.v_proj(hidden).view(patches, -1, self.head_dim), self.eps)
        # Every patch attends to every patch of its image; q and k are normed, so the scores are not scaled.
        attended = F.scaled_dot_product_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), scale=1.0, enable_gqa=True
        )
        return self.o_proj(attended.transpose(0, 1).reshape(patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size, units, clipped = config.hidden_size, config.intermediate_size, config.clipped_linears
        self.gate_proj = ClippableLinear(size, units, clipped)
        self.up_proj = ClippableLinear(size, units, clipped)
        self.down_proj = ClippableLinear(units, size, clipped)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [patches, hidden] -> the same
        return self.down_proj(self.activation(self.gate_proj(hidden)) * self.up_proj(hidden))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.eps
        self.input_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.self_attn = VisionAttention(config)
        self.post_attention_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.mlp = VisionMLP(config)
        self.post_feedforward_layernorm = RMSNorm(size, eps, float32_scale=True)

    def forward(self, hidden: torch.Tensor, axes: tuple[AxisRotation, AxisRotation]) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), axes))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class PatchEmbedder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        # [axis (0: column, 1: row), coordinate, hidden]
        self.position_embedding_table = nn.Parameter(torch.empty(2, config.position_embedding_size, config.hidden_size))

    def forward(
        self,
        pixels: torch.Tensor,  # [patches, 3 * patch_size ** 2], in [0, 1]
        positions: torch.Tensor,  # [patches, 2]: (column, row)
    ) -> torch.Tensor:  # -> [patches, hidden]
        hidden = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        return hidden + (table[0][positions[:, 0]] + table[1][positions[:, 1]])


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))


class Gemma4VisionTower(nn.Module):
    std_bias: torch.Tensor  # [hidden] each, buffers with `standardize`
    std_scale: torch.Tensor

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        # One rotary embedding per axis (the same frequencies), so that each keeps its own positions' cos and sin
        # from one layer to the next.
        rope = RopeConfig(theta=config.rope_theta)
        self.rotaries = (RotaryEmbedding(config.head_dim // 2, rope), RotaryEmbedding(config.head_dim // 2, rope))
        if config.standardize:  # from the checkpoint
            self.register_buffer("std_bias", torch.empty(config.hidden_size))
            self.register_buffer("std_scale", torch.empty(config.hidden_size))

    def forward(
        self,
        pixels: torch.Tensor,  # [patches, 3 * patch_size ** 2]: one image's patches, no padding
        positions: torch.Tensor,  # [patches, 2]: each patch's (column, row) on the image's grid
    ) -> torch.Tensor:  # -> [soft tokens, hidden] (patches / pooling_kernel_size ** 2), float32
        columns, rows = positions[:, 0].contiguous(), positions[:, 1].contiguous()
        axes = (AxisRotation(self.rotaries[0], columns), AxisRotation(self.rotaries[1], rows))
        hidden = self.patch_embedder(pixels, positions)
        for layer in self.encoder.layers:
            hidden = layer(hidden, axes)
        pooled = self._pooled(hidden, columns, rows).float() * self.config.hidden_size**0.5
        if self.config.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled

    def _pooled(
        self,
        hidden: torch.Tensor,  # [patches, hidden]
        columns: torch.Tensor,  # [patches]
        rows: torch.Tensor,  # [patches]
    ) -> torch.Tensor:  # -> [soft tokens, hidden]
        """The mean of each pooling_kernel_size square of the grid, squares row by row. Example: a grid 6 patches
        wide and 3 high with kernel 3 gives 2 tokens, the first the mean of columns 0-2, the second of columns 3-5."""
        kernel = self.config.pooling_kernel_size
        width, height = int(columns.max()) + 1, int(rows.max()) + 1
        if width % kernel or height % kernel or width * height != hidden.shape[0]:
            raise ValueError(
                f"{hidden.shape[0]} patches on a {width} x {height} grid: not the whole grid in squares of {kernel}"
            )
        grid = hidden.new_zeros(hidden.shape[1], height, width, dtype=torch.float32)
        grid[:, rows, columns] = hidden.float().t()
        pooled = F.avg_pool2d(grid[None], kernel)[0]  # [hidden, height / kernel, width / kernel]
        return pooled.flatten(1).t().to(hidden.dtype)


class Gemma4VisionEmbedder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.eps = config.eps
        self.embedding_projection = nn.Linear(config.hidden_size, config.text_hidden_size, bias=False)

    def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:  # [tokens, vision hidden] -> [tokens, text hidden]
        return self.embedding_projection(rms_normalize(soft_tokens, self.eps))


class Gemma4ImageEncoder(nn.Module):
    """The image processor's output -> one [soft tokens, text hidden] per image."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = Gemma4VisionTower(config)
        self.embed_vision = Gemma4VisionEmbedder(config)

    def forward(
        self,
        pixels: torch.Tensor,  # [images, max patches, 3 * patch_size ** 2], padded with zeros
        positions: torch.Tensor,  # [images, max patches, 2]: (column, row), (-1, -1) for padding
    ) -> list[torch.Tensor]:
        """Each image alone, without its padding (the same as attending over the padded rows with the padding
        masked, as transformers does)."""
        dtype = self.embed_vision.embedding_projection.weight.dtype
        features = []
        for image_pixels, image_positions in zip(pixels, positions, strict=True):
            real = (image_positions >= 0).all(dim=-1)
            soft_tokens = self.vision_tower(image_pixels[real], image_positions[real].long())
            features.append(self.embed_vision(soft_tokens.to(dtype)))
        return features


def load_gemma4_image_encoder(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Gemma4ImageEncoder:
    """The image encoder of a Gemma 4 multimodal checkpoint, its tensors read from `model_dir`."""
    config = VisionConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return loaded_module(model_dir, lambda: Gemma4ImageEncoder(config), NAMES, _not_read, dtype, device)


def _not_read(name: str) -> bool:
    return not name.startswith(READ)
