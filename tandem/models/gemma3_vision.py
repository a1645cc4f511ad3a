"""Gemma 3's image encoder, as its multimodal checkpoints ship it: the SigLIP vision tower and the multimodal projector.

An image of `image_size` x `image_size` pixels (made by the checkpoint's own image processor: resize, rescale,
normalize) is cut into patches of `patch_size` by a strided
convolution; each patch gets a learned position embedding; the encoder layers (LayerNorm, bidirectional attention
over all the image's patches with q/k/v/out biases, LayerNorm, a GELU MLP, each with its residual) and a last
LayerNorm follow. The projector lays the patches back on their square grid, averages them in windows down to
`mm_tokens_per_image` (256: a 64 x 64 grid pooled 4 x 4), normalizes each with a Gemma RMSNorm (1 + weight) and
multiplies by `mm_input_projection_weight` [vision hidden, text hidden]: one embedding per image placeholder token,
which replaces that token's (unscaled: the text embeddings are multiplied by sqrt(hidden), these are not).

Checkpoint names: `vision_tower.vision_model.*` (the hub files), `vision_tower.*` (transformers' save) or
`model.vision_tower.*` (its in-memory layout), and `multi_modal_projector.*` with or without `model.`; the tower's
attention-pooling head (`head.*`, unused by Gemma 3) is not read. Checked against transformers'
`Gemma3Model.get_image_features` (tests/unit/test_gemma3_vision.py).
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
from tandem.models.config import ConfigError
from tandem.weights.loader import NameMap, loaded_module

NAMES = NameMap(
    renames=(
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    packed={},  # q/k/v are three Linears here, as in the checkpoint
)
READ = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
NOT_READ = ("vision_tower.head.", "vision_tower.vision_model.head.", "model.vision_tower.head.")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    eps: float
    activation: str
    tokens_per_image: int  # mm_tokens_per_image: a square number, the pooled grid's cells
    text_hidden_size: int

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> VisionConfig:
        """A Gemma 3 multimodal config.json's vision_config, mm_tokens_per_image and text hidden size."""
        vision, text = hf.get("vision_config"), hf.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ConfigError("vision_config and text_config: a Gemma 3 multimodal config.json has both")
        config = VisionConfig(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision.get("num_channels", 3),
            eps=vision.get("layer_norm_eps", 1e-6),
            activation=vision.get("hidden_act", "gelu_pytorch_tanh"),
            tokens_per_image=hf.get("mm_tokens_per_image", 256),
            text_hidden_size=text["hidden_size"],
        )
        side, pooled = config.image_size // config.patch_size, round(config.tokens_per_image**0.5)
        if pooled * pooled != config.tokens_per_image or side % pooled:
            raise ConfigError(
                f"mm_tokens_per_image: {config.tokens_per_image} is not a square whose side divides the "
                f"{side} x {side} patch grid (image_size {config.image_size}, patch_size {config.patch_size})"
            )
        return config


class SiglipAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.heads = config.num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(size, size) for _ in range(3))
        self.out_proj = nn.Linear(size, size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [images, patches, hidden] -> the same
        images, patches, _ = hidden.shape
        q, k, v = (
            projection(hidden).view(images, patches, self.heads, -1).transpose(1, 2)
            for projection in (self.q_proj, self.k_proj, self.v_proj)
        )
        attended = F.scaled_dot_product_attention(q, k, v)  # every patch attends to every patch of its image
        return self.out_proj(attended.transpose(1, 2).reshape(images, patches, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(hidden)))


class SiglipLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.eps)
        self.mlp = SiglipMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class SiglipEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, size, config.patch_size, stride=config.patch_size)
        self.position_embedding = nn.Embedding((config.image_size // config.patch_size) ** 2, size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [images, channels, H, W] -> [images, patches, hidden]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(config) for _ in range(config.num_layers))


class SiglipTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # -> [images, patches, hidden]
        hidden = self.embeddings(pixels)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class Gemma3Projector(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.hidden_size, config.text_hidden_size))
        self.mm_soft_emb_norm = RMSNorm(config.hidden_size, config.eps, unit_offset=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [images, patches, vision] -> [images, tokens, text]
        config = self.config
        images, _, size = patches.shape
        side = config.image_size // config.patch_size
        grid = patches.transpose(1, 2).reshape(images, size, side, side)
        window = side // round(config.tokens_per_image**0.5)
        pooled = F.avg_pool2d(grid, window).flatten(2).transpose(1, 2)  # [images, tokens, vision], row by row
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(patches.dtype)


class Gemma3ImageEncoder(nn.Module):
    """Pixel values [images, channels, image_size, image_size] -> [images, mm_tokens_per_image, text hidden]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = SiglipTower(config)
        self.multi_modal_projector = Gemma3Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        return self.multi_modal_projector(self.vision_tower(pixels.to(dtype)))


def load_gemma3_image_encoder(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Gemma3ImageEncoder:
    """The image encoder of a Gemma 3 multimodal checkpoint, its tensors read from `model_dir`."""
    config = VisionConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return loaded_module(model_dir, lambda: Gemma3ImageEncoder(config), NAMES, _not_read, dtype, device)


def _not_read(name: str) -> bool:
    return not name.startswith(READ) or name.startswith(NOT_READ)
