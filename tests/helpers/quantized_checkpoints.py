"""Quantized copies of tiny float checkpoints, made by the formats' own rules, and their reference dequantization.

Each writer takes a float checkpoint directory (written by transformers), quantizes some of its 2-d weights, and
writes two directories: the quantized checkpoint (with its quantization_config) and a float checkpoint holding the
reference dequantization of exactly those quantized values (what transformers then runs as the reference model).
The references here are written from the formats' definitions, loop by loop, independently of tandem.weights.quantized:
- block-wise fp8 (DeepSeek-V3): per [bh, bw] block (partial at the edges) scale_inv = amax / 448, fp8 = w / scale_inv
  cast to float8 e4m3; reference w = fp8 * scale_inv;
- compressed-tensors pack-quantized INT4, group-wise symmetric (Kimi-K2.5): per group of columns scale = amax / 7
  (stored bfloat16), q = round(w / scale) clamped to -8..7; column c is packed as q + 8 into bits 4 * (c % 8) of word
  c // 8; reference w = q * scale.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from bench.deepseek_layout import int4_experts_config

FP8_MAX = 448.0  # largest float8 e4m3 value


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] float -> (fp8 [rows, cols], scale_inv float32 [ceil(rows / bh), ceil(cols / bw)])."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale_inv = torch.empty(grid, dtype=torch.float32)
    quantized = torch.empty((rows, cols), dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            window = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            values = weight[window].float()
            scale_inv[i, j] = values.abs().max().clamp(min=1e-12) / FP8_MAX
            quantized[window] = (values / scale_inv[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def dequantize_block_fp8_reference(
    quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    result = torch.empty(quantized.shape, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            window = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            result[window] = quantized[window].float() * scale_inv[i, j]
    return result


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] float -> (q int8 [rows, cols] in -8..7, scale bfloat16 [rows, ceil(cols / group)])."""
    rows, cols = weight.shape
    scale = torch.empty((rows, math.ceil(cols / group)), dtype=torch.bfloat16)
    q = torch.empty((rows, cols), dtype=torch.int8)
    for g in range(scale.shape[1]):
        columns = slice(g * group, (g + 1) * group)
        scale[:, g] = (weight[:, columns].abs().amax(dim=1).clamp(min=1e-12) / 7).to(torch.bfloat16)
        q[:, columns] = (weight[:, columns] / scale[:, g : g + 1].float()).round().clamp(-8, 7).to(torch.int8)
    return q, scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[rows, cols] int8 in -8..7 -> [rows, ceil(cols / 8)] int32, compressed-tensors' packing (unused nibbles 0)."""
    rows, cols = q.shape
    words = [[0] * math.ceil(cols / 8) for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            words[r][c // 8] |= (int(q[r, c]) + 8) << (4 * (c % 8))
    signed = [[word - (1 << 32) if word >= 1 << 31 else word for word in row] for row in words]
    return torch.tensor(signed, dtype=torch.int32)


def fp8_config(block: tuple[int, int]) -> dict[str, Any]:
    """quantization_config as DeepSeek-V3's config.json has it (there with 128 x 128 blocks)."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def int4_config(group: int) -> dict[str, Any]:
    """quantization_config as Kimi-K2.5's text_config has it (there with groups of 32)."""
    return int4_experts_config(group)


def write_fp8(
    source: Path, quantized_dir: Path, reference_dir: Path, block: tuple[int, int], head: bool = False
) -> None:
    """Every projection of the decoder layers in fp8 (not the routers, norms, embedding or head, as DeepSeek-V3); with
    `head` the LM head too (no release does: a head kept as stored, for the tables drafts pull)."""

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        # The decoder layers' projections: 2-d, neither a norm nor the router (mlp.gate).
        projection = ".layers." in name and weight.dim() == 2 and "norm" not in name
        if not (projection and not name.endswith(".mlp.gate.weight")) and not (head and name == "lm_head.weight"):
            return None
        fp8, scale_inv = quantize_block_fp8(weight, block)
        stored = {name: fp8, name.removesuffix("weight") + "weight_scale_inv": scale_inv}
        return stored, dequantize_block_fp8_reference(fp8, scale_inv, block)

    _write(
        source,
        quantized_dir,
        reference_dir,
        quantize,
        lambda config: config | {"quantization_config": fp8_config(block)},
    )


def write_int4_experts(source: Path, quantized_dir: Path, reference_dir: Path, group: int) -> None:
    """The routed experts in INT4 (Kimi-K2.5); quantization_config in the text_config when there is one."""

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
            return None
        q, scale = quantize_int4(weight, group)
        prefix = name.removesuffix("weight")
        stored = {
            prefix + "weight_packed": pack_int4(q),
            prefix + "weight_scale": scale,
            prefix + "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64),
        }
        return stored, q.float() * scale.float().repeat_interleave(group, dim=1)[:, : weight.shape[1]]

    def configure(config: dict[str, Any]) -> dict[str, Any]:
        if "text_config" in config:
            return config | {"text_config": config["text_config"] | {"quantization_config": int4_config(group)}}
        return config | {"quantization_config": int4_config(group)}

    _write(source, quantized_dir, reference_dir, quantize, configure)


Quantizer = Callable[[str, torch.Tensor], "tuple[dict[str, torch.Tensor], torch.Tensor] | None"]


def _write(
    source: Path,
    quantized_dir: Path,
    reference_dir: Path,
    quantize: Quantizer,
    configure: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        result = quantize(name, tensor)
        if result is None:
            quantized[name] = reference[name] = tensor
        else:
            quantized |= result[0]
            reference[name] = result[1].to(tensor.dtype)
    if len(reference) == len(quantized):
        raise ValueError(f"nothing quantized in {source}")
    for directory, stored in ((quantized_dir, quantized), (reference_dir, reference)):
        shutil.copytree(source, directory)
        save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (quantized_dir / "config.json").write_text(json.dumps(configure(config), indent=2) + "\n")
