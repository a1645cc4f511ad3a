"""The two quantized weight formats Tandem reads, as the releases ship them: a weight's stored parts, a rank's slice of
them, and their float values.

- block-wise fp8 (`quant_method: fp8`, DeepSeek-V3 and Kimi-K2): `X.weight` float8 e4m3 [rows, cols] and
  `X.weight_scale_inv` float32 [ceil(rows / bh), ceil(cols / bw)] for `weight_block_size: [bh, bw]`;
  w[i, j] = fp8[i, j] * scale_inv[i // bh, j // bw], edge blocks partial (DeepSeek's own dequantization).
- compressed-tensors pack-quantized INT4, group-wise and symmetric (`quant_method: compressed-tensors`, Kimi-K2.5's
  routed experts): `X.weight_packed` int32 [rows, ceil(cols / 8)], `X.weight_scale` [rows, ceil(cols / group)],
  `X.weight_shape` [2]. Column c of a row is the 4 bits at 4 * (c % 8) of word c // 8 (least significant first),
  stored as q + 8 for q in -8..7; w[r, c] = q * scale[r, c // group]. There is no zero point (symmetric).

Each format says what its stored parts are for a weight of a given shape (`stored_shapes`), how many of the weight's
rows and columns one stored element covers (`cells`), which parts a weight kept as stored holds in memory (`kept`:
all but INT4's weight_shape, which the layer's own shape gives) and how they expand to float32 (`expand_into`,
tandem.layers.stored). A rank's slice of the stored form is cut along whole cells (`stored_slices`), or refused.

Values are computed in float32 and then cast to the serving dtype. For INT4 the float32 product is exact, so at the
scales' own dtype (bfloat16 for Kimi-K2.5) this equals compressed-tensors' decompression; for fp8 it is transformers'
and DeepSeek's (a float32 product, then the cast).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.errors import StartupError
from tandem.parallel.layers import ShardSpec

INT4_PER_WORD = 8  # compressed-tensors packs 8 four-bit values into one int32 word
# A part's cells: the weight rows and columns one stored element covers; None: the part is stored whole on every rank.
Cells = tuple[int, int] | None


class QuantizationError(StartupError):
    """A quantized checkpoint that Tandem cannot read or split; the message names the field or tensor."""


class Stored(Protocol):
    """A checkpoint tensor not read yet (tandem.weights.loader.StoredTensor)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name of the stored dtype, e.g. "F8_E4M3", "BF16", "I32"

    def read(self, spec: ShardSpec | None = None) -> torch.Tensor: ...


def scale_columns(values: torch.Tensor, scales: torch.Tensor, width: int) -> None:
    """values[r, c] *= scales[r, c // width] in place, for [rows, cols] values and [rows, ceil(cols / width)] scales,
    without a [rows, cols] copy of the scales."""
    whole = values.shape[1] // width  # column groups of full width
    values[:, : whole * width].unflatten(1, (whole, width)).mul_(scales[:, :whole, None])
    if whole < scales.shape[1]:  # a partial last group
        values[:, whole * width :].mul_(scales[:, whole:])


# float16's exponent bias (15) over float8 e4m3's (7): an e4m3 value's bits moved into a float16 read 2 ** -8 of it.
FP8_AS_FLOAT16 = 2.0**8


def fp8_as_float16(weight: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 [...] -> float16 [...] of the values / 256, exactly, by moving the bits: s eeee mmm becomes
    s 0eeee mmm 0000000 (subnormals too: m / 8 * 2 ** -6 becomes m / 8 * 2 ** -14). The int16 shift and mask run
    vectorized, where torch's float8 conversion runs an element at a time (about 15x slower on the CPU). e4m3's NaN
    (s 1111 111), which no release's weights hold, reads as 480 / 256 rather than NaN: looking for it would take a pass
    over every weight at load."""
    bits = weight.view(torch.int8).to(torch.int16)  # sign-extended: after the shift bits 14 and 15 hold the sign
    bits <<= 7  # in place: half the time of new tensors
    bits &= ~0x4000  # bit 14 cleared: the sign stays in bit 15 alone
    return bits.view(torch.float16)


def block_fp8_into(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], out: torch.Tensor) -> None:
    """[rows, cols] fp8 and [ceil(rows / bh), ceil(cols / bw)] scales -> `out` [rows, cols] float32. Each value is
    (fp8 / 256) * (scale * 256) of two exact float32 factors: the float32 product fp8 * scale, bit for bit."""
    scales = (scale_inv.float() * FP8_AS_FLOAT16).repeat_interleave(block[0], dim=0)[: weight.shape[0]]
    scale_columns(out.copy_(fp8_as_float16(weight)), scales, block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] fp8 and [ceil(rows / bh), ceil(cols / bw)] scales -> [rows, cols] float32."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    block_fp8_into(weight, scale_inv, block, out)
    return out


def int4_values_into(packed: torch.Tensor, out: torch.Tensor) -> None:
    """[rows, words] int32, 8 values a word, least significant nibble first, each stored as q + 8 -> `out`
    [rows, columns] float32 of q in -8..7. Example: word 0x0000_00F1 holds q = 1 - 8 = -7 in column 0, 15 - 8 = 7 in
    column 1 and 0 - 8 = -8 in columns 2..7.

    The words are read as their bytes (torch's CPU and CUDA tensors are little-endian: byte b of a row holds columns
    2b in its low nibble and 2b + 1 in its high one), each nibble plane made q in int8 and written to every other
    column: a few passes over bytes and one float32 write, where shifting int32 words takes several over words."""
    rows, columns = out.shape
    width = INT4_PER_WORD * packed.shape[1]
    full = out if columns == width else out.new_empty((rows, width))  # a partial last word: its padding cut below
    stored_bytes = packed.contiguous().view(torch.uint8)  # [rows, 4 * words]
    pairs = full.view(rows, -1, 2)  # [rows, 4 * words, 2]: columns 2b, 2b + 1
    pairs[..., 0].copy_((stored_bytes & 0xF).view(torch.int8).sub_(8))
    pairs[..., 1].copy_((stored_bytes >> 4).view(torch.int8).sub_(8))
    if full is not out:
        out.copy_(full[:, :columns])


def packed_int4_into(packed: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor) -> None:
    """compressed-tensors' symmetric group-wise INT4 -> `out` [rows, cols] float32."""
    int4_values_into(packed, out)
    scale_columns(out, scale.float(), group)


def dequantize_packed_int4(packed: torch.Tensor, scale: torch.Tensor, shape: Sequence[int], group: int) -> torch.Tensor:
    """compressed-tensors' symmetric group-wise INT4 -> [rows, cols] float32."""
    out = torch.empty((int(shape[0]), int(shape[1])), dtype=torch.float32, device=packed.device)
    packed_int4_into(packed, scale, group, out)
    return out


@dataclass(frozen=True)
class BlockFp8:
    block: tuple[int, int]  # weight_block_size: rows, columns
    marker: str = "weight_scale_inv"
    parts: tuple[str, ...] = ("weight", "weight_scale_inv")
    kept: tuple[str, ...] = ("weight", "weight_scale_inv")

    def describe(self) -> str:
        return f"block-wise fp8 e4m3 ({self.block[0]}x{self.block[1]} blocks)"

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The parts' shapes for a [rows, cols] weight."""
        grid = tuple(math.ceil(size / block) for size, block in zip(shape, self.block, strict=True))
        return {"weight": shape, "weight_scale_inv": grid}

    def stored_dtypes(self) -> dict[str, str]:
        """The safetensors dtype of each part whose dtype the format fixes (the scales may be any float)."""
        return {"weight": "F8_E4M3"}

    def cells(self) -> dict[str, Cells]:
        """Each part's cells: an fp8 value is one weight value, a scale one block."""
        return {"weight": (1, 1), "weight_scale_inv": self.block}

    def cell_names(self) -> dict[str, str]:
        return {"weight": "fp8 value", "weight_scale_inv": "fp8 block"}

    @property
    def row_cell(self) -> int:
        """A run of rows expanded apart starts at a multiple of this (`rows_of`)."""
        return self.block[0]

    def rows_of(self, parts: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """The kept parts of rows [start, stop), start a multiple of `row_cell`."""
        return {
            "weight": parts["weight"][start:stop],
            "weight_scale_inv": parts["weight_scale_inv"][start // self.block[0] : -(-stop // self.block[0])],
        }

    def expand_into(self, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        block_fp8_into(parts["weight"], parts["weight_scale_inv"], self.block, out)

    def fused_product(self, parts: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        """x [rows, cols] @ W^T by tandem.layers.cpu_products where it takes x, else None."""
        from tandem.layers import cpu_products  # Numba: imported where a product needs it

        if not cpu_products.applies(x):
            return None
        return cpu_products.fp8_product(x, parts["weight"], parts["weight_scale_inv"], self.block)

    def weight(self, prefix: str, parts: dict[str, Stored], dtype: torch.dtype) -> QuantizedTensor:
        weight, scale = parts["weight"], parts["weight_scale_inv"]
        if len(weight.shape) != 2 or weight.dtype != self.stored_dtypes()["weight"]:
            raise QuantizationError(
                f"tensor {prefix}weight: expected a 2-d float8 e4m3 weight, got {weight.dtype} {list(weight.shape)}"
            )
        grid = self.stored_shapes(weight.shape)["weight_scale_inv"]
        if scale.shape != grid:
            raise QuantizationError(
                f"tensor {prefix}weight_scale_inv: expected shape {grid} ({self.describe()} of "
                f"{list(weight.shape)}), got {scale.shape}"
            )
        return QuantizedTensor(prefix + "weight", weight.shape, self, parts, dtype)


@dataclass(frozen=True)
class PackedInt4:
    group_size: int
    marker: str = "weight_packed"
    parts: tuple[str, ...] = ("weight_packed", "weight_scale", "weight_shape")
    kept: tuple[str, ...] = ("weight_packed", "weight_scale")

    def describe(self) -> str:
        return f"compressed-tensors pack-quantized int4 (symmetric, groups of {self.group_size})"

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The parts' shapes for a [rows, cols] weight."""
        rows, cols = shape
        return {
            "weight_packed": (rows, math.ceil(cols / INT4_PER_WORD)),
            "weight_scale": (rows, math.ceil(cols / self.group_size)),
            "weight_shape": (2,),
        }

    def stored_dtypes(self) -> dict[str, str]:
        """The safetensors dtype of each part whose dtype the format fixes (the scales may be any float)."""
        return {"weight_packed": "I32"}

    def cells(self) -> dict[str, Cells]:
        """Each part's cells: a word is 8 values of a row, a scale one group of a row; weight_shape is whole."""
        return {"weight_packed": (1, INT4_PER_WORD), "weight_scale": (1, self.group_size), "weight_shape": None}

    def cell_names(self) -> dict[str, str]:
        return {"weight_packed": "int4 word", "weight_scale": "int4 group", "weight_shape": "shape"}

    @property
    def row_cell(self) -> int:
        """A run of rows expanded apart starts at a multiple of this (`rows_of`): any row."""
        return 1

    def rows_of(self, parts: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """The kept parts of rows [start, stop)."""
        return {name: parts[name][start:stop] for name in self.kept}

    def expand_into(self, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        packed_int4_into(parts["weight_packed"], parts["weight_scale"], self.group_size, out)

    def fused_product(self, parts: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        """x [rows, cols] @ W^T by tandem.layers.cpu_products where it takes x and these groups, else None."""
        from tandem.layers import cpu_products  # Numba: imported where a product needs it

        if not (cpu_products.applies(x) and cpu_products.int4_applies(self.group_size)):
            return None
        return cpu_products.int4_product(x, parts["weight_packed"], parts["weight_scale"], self.group_size)

    def weight(self, prefix: str, parts: dict[str, Stored], dtype: torch.dtype) -> QuantizedTensor:
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        shape = tuple(int(size) for size in parts["weight_shape"].read().tolist())
        if len(shape) != 2 or packed.dtype != self.stored_dtypes()["weight_packed"]:
            raise QuantizationError(
                f"tensor {prefix}weight_packed: expected int32 words of a 2-d weight, got {packed.dtype} and "
                f"weight_shape {list(shape)}"
            )
        expected_shapes = self.stored_shapes(shape)
        for name, stored in (("weight_packed", packed), ("weight_scale", scale)):
            expected = expected_shapes[name]
            if stored.shape != expected:
                raise QuantizationError(
                    f"tensor {prefix}{name}: expected shape {expected} for weight_shape {list(shape)} "
                    f"({self.describe()}), got {stored.shape}"
                )
        return QuantizedTensor(prefix + "weight", shape, self, parts, dtype)


Quantization = BlockFp8 | PackedInt4


class QuantizedTensor:
    """A quantized module's weight as the loader sees it: its float shape and its stored parts.

    `read` gives float values in the serving dtype, what a module holding a float weight loads (the whole weight is
    dequantized, then sliced: a shard's rows need not align with the blocks or groups); `read_stored` gives this
    rank's slice of each kept part, what a layer keeping the weight as stored loads (tandem.layers.stored).
    """

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        quantization: Quantization,
        parts: dict[str, Stored],
        dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.shape = shape
        self.dtype = str(dtype)
        self.quantization = quantization
        self.parts = parts
        self._serving_dtype = dtype

    def read(self, spec: ShardSpec | None = None) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32)
        self.quantization.expand_into({name: self.parts[name].read() for name in self.quantization.kept}, out)
        weight = out.to(self._serving_dtype)
        if spec is None or spec.size is None:
            return weight
        return weight.narrow(spec.dim, spec.start, spec.size)

    def read_stored(self, spec: ShardSpec | None) -> dict[str, torch.Tensor]:
        """This rank's slice of every kept part, for its slice `spec` of the float weight (None: the whole)."""
        slices = stored_slices(self.quantization, spec, self.name)
        return {name: self.parts[name].read(slices[name]) for name in self.quantization.kept}


def stored_slices(quantization: Quantization, spec: ShardSpec | None, name: str) -> dict[str, ShardSpec | None]:
    """Each kept part's slice for a rank's slice `spec` of the float weight `name` (None: the part whole). Raises
    QuantizationError naming the weight, its rows or columns per rank and the cell they cut, when the slice starts or
    ends inside a cell (a rank's last cell may be partial where the weight ends). The widest cell is checked first.

    Example: fp8 with 128 x 128 blocks, a [7168, 18432] weight split by columns at tp 8: 2304 columns per rank (18
    blocks); rank 1 holds fp8 columns [2304, 4608) and scale columns [18, 36). Split by rows at tp 16, 448 rows per
    rank would cut the fourth block of rows: refused."""
    slices: dict[str, ShardSpec | None] = dict.fromkeys(quantization.kept)
    if spec is None or spec.size is None:
        return slices
    full = spec.full_shape
    axis = _axis(spec)
    cells = {part: quantization.cells()[part] for part in quantization.kept}
    for part in sorted(quantization.kept, key=lambda part: -_cell(cells[part], axis)):
        span = cell_span(cells[part], spec)
        if span.cut:
            rows = "rows" if axis == 0 else "columns"
            raise QuantizationError(
                f"tensor {name}: {rows} {spec.size} per rank is not a multiple of the {span.cell}-{rows[:-1]} "
                f"{quantization.cell_names()[part]} (this tp would cut it; choose one that does not, or --dequantize)"
            )
        stored_full = (*full[:-2], *quantization.stored_shapes(full[-2:])[part])
        slices[part] = ShardSpec(stored_full, spec.dim, span.first, span.stop - span.first)
    return slices


@dataclass(frozen=True)
class CellSpan:
    """The cells (blocks, groups) along the split dimension that a rank's slice of a weight touches."""

    cell: int  # a cell's extent along that dimension
    first: int  # the first cell touched
    stop: int  # one past the last
    cut: bool  # the slice starts or ends inside a cell (a rank's last cell may be partial where the weight ends)


def cell_span(cells: Cells, spec: ShardSpec) -> CellSpan:
    """The cells of a part with `cells` that a rank's slice `spec` (sized) of the float weight touches."""
    assert spec.size is not None, "a slice of the whole tensor touches every cell"
    cell = _cell(cells, _axis(spec))
    end = spec.start + spec.size
    cut = bool(spec.start % cell or (end % cell and end != spec.full_shape[spec.dim]))
    return CellSpan(cell, spec.start // cell, -(-end // cell), cut)


def _axis(spec: ShardSpec) -> int:
    """The split dimension as cells see it: 0 rows, 1 columns (cells cover the last two), below 0 a leading one."""
    return spec.dim - (len(spec.full_shape) - 2)


def _cell(cells: Cells, axis: int) -> int:
    """A part's cell along `axis` (0 rows, 1 columns; below 0 a leading dimension, cut anywhere)."""
    return 1 if cells is None or axis < 0 else cells[axis]
