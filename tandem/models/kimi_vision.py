"""Kimi-K2.5's image encoder, as its checkpoints ship it: the MoonViT vision tower and the multimodal projector.

The image processor (tandem.models.kimi_image_processor) resizes an image within a patch budget, pads it to a whole
number of merge windows and cuts it into `patch_size` x `patch_size` patches, row by row: an image of h x w patches
comes as h * w rows of pixel values and its grid (1, h, w). The tower embeds each patch (a strided convolution), adds
its learned position embedding (the `pos_emb_height` x `pos_emb_width` table resampled bicubically to h x w, as
`F.interpolate` does, unless the grid is the table's own size), then runs the encoder blocks (LayerNorm,
bidirectional attention over the image's own patches with 2-D rope, LayerNorm, a GELU MLP, each with its residual)
and a last LayerNorm. Rope is axial: a head's dimensions form head_dim / 2 interleaved pairs (2i, 2i + 1), the even
pairs turn with the patch's column and the odd ones with its row, pair j at frequency
rope_theta^(-4 * (j // 2) / head_dim). The projector gathers each merge window (2 x 2 patches) into one token, the
window's patches side by side in row order, normalizes each patch's part (LayerNorm), and maps it through
Linear, GELU, Linear to the text hidden size: one embedding per image placeholder token, h * w / 4 of them.

Checkpoint names, the release's (Moonshot's original MoonViT code): `vision_tower.patch_embed.{proj,pos_emb}.*`,
`vision_tower.encoder.blocks.{i}.{norm0,wqkv,wo,norm1,mlp.fc0,mlp.fc1}.*`, `vision_tower.encoder.final_layernorm.*`,
`mm_projector.{pre_norm,proj.0,proj.2}.*`. transformers renames them when it loads and writes them back on save,
except two: `vision_tower.encoder.patch_embed.proj.*` and `model.mm_projector.pre_norm.*`; both spellings load here.
The q/k rows of `wqkv` are in the release's interleaved pair order in both files (transformers permutes them to
rotate-half at load and back at save). Images only: a video's temporal axis (grid t > 1, the time embedding and the
temporal pooling of frames) is refused. Checked against transformers' `Kimi_K25Model.get_image_features`
(tests/unit/test_kimi_vision.py).
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
from tandem.layers.rotary import rotate_interleaved
from tandem.models.config import ConfigError
from tandem.weights.loader import NameMap, loaded_module

NAMES = NameMap(
    renames=(
        ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
        ("model.mm_projector.", "mm_projector."),
    ),
    packed={},  # wqkv is one Linear in both layouts
)
READ = ("vision_tower.", "mm_projector.", "model.mm_projector.")
TOWER_EPS = 1e-5  # the tower's LayerNorms (a constant in MoonViT, not a config field)


@dataclass(frozen=True)
class KimiVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    position_grid: tuple[int, int]  # (pos_emb_height, pos_emb_width): the learned table's patches
    merge_kernel: tuple[int, int]  # patches per token, (rows, columns)
    activation: str
    rope_theta: float
    projection_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> KimiVisionConfig:
        """A Kimi-K2.5 config.json's vision_config, projector fields and text hidden size (transformers'
        Kimi_K25VisionConfig defaults where the vision_config leaves a field out)."""
        vision, text = hf.get("vision_config"), hf.get("text_config")
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ConfigError("vision_config and text_config: a Kimi-K2.5 config.json has both")
        rope = vision.get("rope_parameters") or {}
        merge = tuple(vision.get("merge_kernel_size", (2, 2)))
        if len(merge) != 2:
            raise ConfigError(f"vision_config.merge_kernel_size: {list(merge)} is not (rows, columns)")
        config = KimiVisionConfig(
            hidden_size=vision.get("hidden_size", 1152),
            intermediate_size=vision.get("intermediate_size", 4304),
            num_layers=vision.get("num_hidden_layers", 27),
            num_heads=vision.get("num_attention_heads", 16),
            patch_size=vision.get("patch_size", 14),
            position_grid=(vision.get("pos_emb_height", 64), vision.get("pos_emb_width", 64)),
            merge_kernel=(merge[0], merge[1]),
            activation=vision.get("hidden_act", "gelu_pytorch_tanh"),
            rope_theta=rope.get("rope_theta", 10000.0),
            projection_eps=hf.get("projection_layer_norm_eps", 1e-5),
            text_hidden_size=text["hidden_size"],
        )
        config.check(hf.get("projection_hidden_size", 1152), rope.get("rope_type", "axial"))
        return config

    def check(self, projection_hidden_size: int, rope_type: str) -> None:
        if projection_hidden_size != self.hidden_size:
            raise ConfigError(
                f"projection_hidden_size: {projection_hidden_size} is not the vision tower's hidden_size "
                f"{self.hidden_size} (the projector's pre_norm normalizes the tower's features)"
            )
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ConfigError(
                f"vision_config.num_attention_heads: {self.num_heads} heads of hidden_size {self.hidden_size} do "
                "not give a head_dim divisible by 4 (2-D rope turns pairs of dimensions by row and by column)"
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act: {self.activation!r} is not one of {sorted(ACTIVATIONS)}")
        if rope_type != "axial":
            raise ConfigError(f"vision_config.rope_parameters.rope_type: {rope_type!r}; MoonViT's rope is 'axial'")


class PositionEmbedding(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*config.position_grid, config.hidden_size))

    def forward(self, height: int, width: int) -> torch.Tensor:  # -> [height * width, hidden], row by row
        if (height, width) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        table = self.weight.float().permute(2, 0, 1)[None]  # [1, hidden, rows, columns]
        resampled = F.interpolate(table, size=(height, width), mode="bicubic", align_corners=False)
        return resampled[0].permute(1, 2, 0).flatten(0, 1).to(self.weight.dtype)


class PatchEmbedding(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        size = config.patch_size
        self.proj = nn.Conv2d(3, config.hidden_size, size, stride=size)
        self.pos_emb = PositionEmbedding(config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        # [patches, 3, patch, patch] -> [patches, hidden]
        embedded = self.proj(pixels).flatten(1)
        positions = torch.cat([self.pos_emb(height, width) for height, width in grids])
        return embedded + positions.to(embedded.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc1 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.activation(self.fc0(hidden)))


class EncoderBlock(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.heads = config.num_heads
        self.norm0 = nn.LayerNorm(size, eps=TOWER_EPS)
        self.wqkv = nn.Linear(size, 3 * size)
        self.wo = nn.Linear(size, size)
        self.norm1 = nn.LayerNorm(size, eps=TOWER_EPS)
        self.mlp = VisionMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,  # [patches, hidden], the images one after the other
        lengths: list[int],  # patches per image
        cos: torch.Tensor,  # [patches, 1, head_dim // 2]
        sin: torch.Tensor,  # [patches, 1, head_dim // 2]
    ) -> torch.Tensor:
        hidden = hidden + self.wo(self.attention(self.norm0(hidden), lengths, cos, sin))
        return hidden + self.mlp(self.norm1(hidden))

    def attention(
        self, hidden: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:  # [patches, hidden] -> [patches, hidden]
        patches = hidden.shape[0]
        query, key, value = self.wqkv(hidden).view(patches, 3, self.heads, -1).unbind(1)
        query, key = rotate_interleaved(query, cos, sin), rotate_interleaved(key, cos, sin)
        attended = [
            F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
            for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)
        ]  # every patch attends to every patch of its own image
        return torch.cat(attended).reshape(patches, -1)


class Encoder(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=TOWER_EPS)


class MoonVit(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbedding(config)
        self.encoder = Encoder(config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        # [patches, 3, patch, patch] -> [tokens, rows * columns of a merge window, hidden]
        hidden = self.patch_embed(pixels, grids)
        cos, sin = axial_rope(grids, self.config, hidden.device)
        lengths = [height * width for height, width in grids]
        for block in self.encoder.blocks:
            hidden = block(hidden, lengths, cos, sin)
        hidden = self.encoder.final_layernorm(hidden)
        return torch.cat(
            [
                merge_windows(image, grid, self.config.merge_kernel)
                for image, grid in zip(hidden.split(lengths), grids, strict=True)
            ]
        )


def axial_rope(
    grids: list[tuple[int, int]], config: KimiVisionConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # -> cos, sin: [patches, 1, head_dim // 2] each
    """Each patch's angle for each interleaved pair: pair j turns by the patch's column (j even) or row (j odd)
    times rope_theta^(-4 * (j // 2) / head_dim). Computed in float32, as transformers does."""
    half = config.head_dim // 2
    inverse = 1.0 / (config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
    angles = []
    for height, width in grids:
        rows, columns = torch.meshgrid(
            torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij"
        )
        turns = torch.stack((columns.flatten(), rows.flatten()), dim=-1).float()  # [h * w, 2]: (column, row)
        angles.append((turns[:, None, :] * inverse[None, :, None]).flatten(1))  # [h * w, head_dim // 2]
    angle = torch.cat(angles)[:, None, :]
    return angle.cos(), angle.sin()


def merge_windows(image: torch.Tensor, grid: tuple[int, int], kernel: tuple[int, int]) -> torch.Tensor:
    """[h * w, hidden] (row by row) -> [h / kh * w / kw, kh * kw, hidden]: one entry per merge window, windows row
    by row, each window's patches row by row. E.g. a 4 x 4 grid, 2 x 2 windows: window 1 (top right) holds patches
    2, 3, 6, 7."""
    (height, width), (rows, columns) = grid, kernel
    windows = image.view(height // rows, rows, width // columns, columns, -1).permute(0, 2, 1, 3, 4)
    return windows.reshape((height // rows) * (width // columns), rows * columns, -1)


class Projector(nn.Module):
    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        window = config.hidden_size * config.merge_kernel[0] * config.merge_kernel[1]
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.projection_eps)
        self.proj = nn.Sequential(nn.Linear(window, window), nn.GELU(), nn.Linear(window, config.text_hidden_size))

    def forward(self, windows: torch.Tensor) -> torch.Tensor:  # [tokens, window patches, vision] -> [tokens, text]
        return self.proj(self.pre_norm(windows).flatten(1))


class KimiImageEncoder(nn.Module):
    """Pixel values [patches, 3, patch, patch] and grids [images, 3] (the image processor's image_grid_thw) ->
    [tokens, text hidden], the images' tokens one image after the other (h * w / 4 per image of h x w patches)."""

    def __init__(self, config: KimiVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = MoonVit(config)
        self.mm_projector = Projector(config)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self.image_grids(grid_thw, pixels.shape[0])
        dtype = self.mm_projector.pre_norm.weight.dtype
        return self.mm_projector(self.vision_tower(pixels.to(dtype), grids))

    def image_grids(self, grid_thw: torch.Tensor, patches: int) -> list[tuple[int, int]]:
        """grid_thw [images, 3] -> (h, w) per image; refuses videos and grids the pixels or merge windows don't fit."""
        rows, columns = self.config.merge_kernel
        grids = []
        for frames, height, width in grid_thw.tolist():
            if frames != 1 or height % rows or width % columns:
                raise ValueError(
                    f"image grid (t {frames}, h {height}, w {width}): not one frame of whole {rows} x {columns} "
                    "merge windows"
                )
            grids.append((height, width))
        if sum(height * width for height, width in grids) != patches:
            raise ValueError(f"image grids {grids} do not hold the {patches} patches of the pixel values")
        return grids


def load_kimi_image_encoder(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> KimiImageEncoder:
    """The image encoder of a Kimi-K2.5 checkpoint, its tensors read from `model_dir`."""
    config = KimiVisionConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return loaded_module(model_dir, lambda: KimiImageEncoder(config), NAMES, _not_read, dtype, device)


def _not_read(name: str) -> bool:
    return not name.startswith(READ)
