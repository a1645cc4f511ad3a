"""Products with group-wise INT4 weights on the GPU: torch's tinygemm kernel (torch.ops.aten._weight_int4pack_mm),
what torchao runs for int4 weight-only layers, taking bfloat16 activations and the weight as 4-bit values.

A weight of compressed-tensors' INT4 (Kimi-K2.5's routed experts: int32 words of 8 values, q + 8 per nibble, column
2b in the low nibble of byte b and 2b + 1 in the high one; a scale per row and group) is repacked once at load
(`pack`): its bytes with their nibbles swapped are the [rows, columns / 2] uint8 input that
torch.ops.aten._convert_weight_to_int4pack takes (column 2b in the high nibble), which tiles them for the kernel; the
scales become its [groups, rows, 2] table of (scale, zero) with zero 0, since tinygemm computes (q - 8) * scale + zero
and the format is symmetric. The tiled weight takes the words' bytes; the table twice the scales'.

It applies on CUDA to a bfloat16 model, groups of 32 to 256 columns, rows a multiple of 8 and columns of whole
k-tiles (INNER_K_TILES * 16); elsewhere the weight stays in its words and is expanded per product
(tandem.layers.stored). The CPU checks what it can of this (the nibble order, and the table through torch's CPU
version of the kernel, tests/unit/test_int4_products.py); tests/cuda/test_int4_products.py checks the kernel.
"""

from __future__ import annotations

import torch

INNER_K_TILES = 8  # k-tiles of 16 columns the kernel takes at a time: columns a multiple of 128
GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm takes
PACKED_PARTS = ("int4pack", "scales_and_zeros")  # what a repacked weight keeps, in the order `product` takes


def applies(device: torch.device, dtype: torch.dtype, group: int, shape: tuple[int, int]) -> bool:
    """Whether a [rows, columns] INT4 weight in groups of `group` columns, in a model of `dtype` on `device`, is
    repacked and multiplied by tinygemm."""
    rows, columns = shape
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and group in GROUPS
        and rows % 8 == 0
        and columns % (INNER_K_TILES * 16) == 0
        and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    )


def nibble_bytes(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' words [rows, columns / 8] int32 -> [rows, columns / 2] uint8, column 2b in the high nibble
    of byte b and 2b + 1 in the low one, each still q + 8."""
    stored = words.contiguous().view(torch.uint8)  # little-endian: byte b holds column 2b low, 2b + 1 high
    return (stored << 4) | (stored >> 4)


def scales_and_zeros(scale: torch.Tensor) -> torch.Tensor:
    """Scales [rows, groups] -> tinygemm's [groups, rows, 2] bfloat16 table of (scale, zero 0)."""
    scale = scale.to(torch.bfloat16).t()
    return torch.stack((scale, torch.zeros_like(scale)), dim=-1).contiguous()


def pack(words: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """One weight's words and scales (on the GPU) -> its PACKED_PARTS."""
    tiled = torch.ops.aten._convert_weight_to_int4pack(nibble_bytes(words), INNER_K_TILES)
    return {"int4pack": tiled, "scales_and_zeros": scales_and_zeros(scale)}


def product(x: torch.Tensor, int4pack: torch.Tensor, table: torch.Tensor, group: int) -> torch.Tensor:
    """x [tokens, columns] bfloat16 @ W^T -> [tokens, rows] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm(x, int4pack, group, table)
