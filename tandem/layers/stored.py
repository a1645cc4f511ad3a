"""A linear layer's weight kept as a quantized checkpoint stores it, expanded to the serving dtype before each product.

The formats (block-wise fp8, compressed-tensors INT4: tandem.weights.formats) say which stored parts a weight keeps
in memory and how they expand to float32 values. A `StoredWeight` holds those parts segment by segment: a plain Linear
has one segment (None), a PackedLinear one per part (q/k/v, gate/up), since each part is a checkpoint tensor of its
own with its own blocks or groups. A segment holds this rank's rows of its part; a stack of experts
(PackedLinear with `experts` > 1) keeps every expert's parts with a leading expert dimension.

The parts are buffers named `{segment}_{part}` (`weight` and `weight_scale_inv` for a plain fp8 Linear,
`gate_weight_packed` ... for a packed INT4 one), registered as the loader hands them over (`load`): the float weight
they stand for is never allocated, and a model's memory is the stored bytes plus its float parts.

A product takes the stored form directly where a kernel does (`kernel_product`: fp8 tensor cores and tinygemm's INT4
on the GPU, an INT4 weight then repacked at load for it; a fused CPU kernel for a few rows). Elsewhere `chunks`
expands the weight a run of rows at a time, each run multiplied while it is in the cache
(tandem.layers.matmul.stored_linear, what Linear.forward runs). `expanded` builds the whole float weight (MLA's
absorbed kv_b_proj, a head drafts pull) and `expert` one expert's rows of one part. Expansion happens only in a
layer's forward, so a mixture of experts expands only the experts a step routes to (tandem.layers.moe runs only
those).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

import torch
from torch import nn

from tandem.layers import int4_products
from tandem.layers.fp8_products import applies, scaled_block_mm

# Values a run of expanded rows holds (`StoredWeight.chunks`): 4 MiB in float32, which the cache keeps between its
# expansion and its product.
CHUNK_VALUES = 2**20
FP8_PARTS = ("weight", "weight_scale_inv")  # block-wise fp8's kept parts, in the order scaled_block_mm takes them
INT4_PARTS = ("weight_packed", "weight_scale")  # compressed-tensors INT4's, in the order int4_products.pack takes them


class StoredFormat(Protocol):
    """What a StoredWeight needs of a quantization format (tandem.weights.formats.BlockFp8, PackedInt4)."""

    @property
    def kept(self) -> tuple[str, ...]: ...  # the stored parts held in memory, e.g. ("weight", "weight_scale_inv")

    def stored_shapes(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]: ...  # for a [rows, cols] weight

    @property
    def row_cell(self) -> int: ...  # a run of rows expanded apart starts at a multiple of this (a block's rows)

    def rows_of(self, parts: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
        """The stored parts of rows [start, stop) of one weight, start a multiple of `row_cell`."""
        ...

    def expand_into(self, parts: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        """Writes the float32 values of one stored [rows, cols] weight into `out` ([rows, cols] float32)."""
        ...

    def fused_product(self, parts: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor | None:
        """x [tokens, cols] @ W^T for one stored [rows, cols] weight without expanding it, or None where no kernel
        takes x (tandem.layers.cpu_products)."""
        ...


class StoredWeight(nn.Module):
    """One layer's weight as stored, on this rank: its segments' kept parts as buffers (module docstring)."""

    def __init__(
        self,
        format: StoredFormat,
        segments: dict[str | None, int],  # segment -> this rank's rows of one expert, in the weight's row order
        columns: int,  # this rank's columns (the layer's in_features)
        dtype: torch.dtype,  # the serving dtype the weight expands to
        device: torch.device | str,
        experts: int = 1,
    ) -> None:
        super().__init__()
        self.format = format
        self.segments = segments
        self.columns = columns
        self.dtype = dtype
        self.device = torch.device(device)
        self.experts = experts
        self._kernel: bool | None = None  # whether kernel_product applies, once asked
        self._tinygemm_group = self._tinygemm()  # fixed by the format, shapes, device and dtype

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape on this rank: [out, in]."""
        return self.experts * sum(self.segments.values()), self.columns

    def load(self, segment: str | None, parts: Mapping[str, torch.Tensor]) -> None:
        """Keeps this rank's slice of one segment's stored parts (every kept part); ValueError naming a part whose
        shape is not the one the segment takes."""
        expected = self.format.stored_shapes((self.segments[segment], self.columns))
        for name in self.format.kept:
            shape = (self.experts, *expected[name]) if self.experts > 1 else expected[name]
            tensor = parts[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape} on this rank, got {tuple(tensor.shape)}")
            # A copy the process owns, as a float weight's: a tensor read from the checkpoint may map its file.
            self.register_buffer(_buffer_name(segment, name), tensor.to(self.device, copy=True))
        if self._tinygemm_group is not None:  # repacked for the kernel: the words and scales give way to its parts
            packed = int4_products.pack(*(self.get_buffer(_buffer_name(segment, name)) for name in INT4_PARTS))
            for name in INT4_PARTS:
                delattr(self, _buffer_name(segment, name))
            for name, tensor in packed.items():
                self.register_buffer(_buffer_name(segment, name), tensor)

    def kernel_product(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., in] -> [..., out], or None
        """x @ W^T by a kernel that takes the weight as stored, segment by segment: block-wise fp8 on fp8 tensor cores
        (tandem.layers.fp8_products), INT4 by tinygemm (tandem.layers.int4_products), or a format's fused CPU product
        for a few rows (tandem.layers.cpu_products); None where none applies, and the weight is expanded."""
        if self.experts > 1:
            return None
        tokens = x.reshape(-1, self.columns)
        if self._tensor_cores():
            products = [scaled_block_mm(tokens, *self._parts(segment, 0).values()) for segment in self.segments]
        elif group := self._tinygemm_group:
            products = [int4_products.product(tokens, *self._packed(segment), group) for segment in self.segments]
        else:
            fused = [self.format.fused_product(self._parts(segment, 0), tokens) for segment in self.segments]
            if any(product is None for product in fused):
                return None
            products = [product.to(x.dtype) for product in fused if product is not None]
        return torch.cat(products, dim=-1).view(*x.shape[:-1], -1)

    def _tensor_cores(self) -> bool:
        """Whether scaled_block_mm multiplies this weight (asked once)."""
        if self._kernel is None:
            block = getattr(self.format, "block", None)
            self._kernel = (
                block is not None
                and tuple(self.format.kept) == FP8_PARTS
                and all(applies(self.device, block, (rows, self.columns)) for rows in self.segments.values())
            )
        return self._kernel

    def _tinygemm(self) -> int | None:
        """This INT4 weight's group size where it is repacked for tinygemm and multiplied by it
        (tandem.layers.int4_products), else None; asked once, at construction."""
        group = getattr(self.format, "group_size", None)
        if group is None or self.experts > 1 or tuple(self.format.kept) != INT4_PARTS:
            return None
        shapes = [(rows, self.columns) for rows in self.segments.values()]
        return group if all(int4_products.applies(self.device, self.dtype, group, shape) for shape in shapes) else None

    def _packed(self, segment: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        tiled, table = (self.get_buffer(_buffer_name(segment, name)) for name in int4_products.PACKED_PARTS)
        return tiled, table

    def expanded(self) -> torch.Tensor:  # -> [out, in] in the serving dtype
        if self._tinygemm_group is not None:  # the words are gone: the kernel's product with the identity is W^T
            identity = torch.eye(self.columns, dtype=self.dtype, device=self.device)
            product = self.kernel_product(identity)
            assert product is not None
            return product.t().contiguous()
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for rows, weight in self.chunks():
            out[rows] = weight
        return out

    def expert(self, segment: str | None, expert: int) -> torch.Tensor:  # -> [rows of one expert, in]
        """One expert's rows of one segment, expanded."""
        out = torch.empty((self.segments[segment], self.columns), dtype=torch.float32, device=self.device)
        self.format.expand_into(self._parts(segment, expert), out)
        return out.to(self.dtype)

    def chunks(self, values: int = CHUNK_VALUES) -> Iterator[tuple[slice, torch.Tensor]]:
        """The weight expanded a run of rows at a time, in row order: (rows, [len(rows), in] in the serving dtype).
        A run holds about `values` values, in a float32 buffer reused from run to run (valid until the next), so that
        what is expanded is multiplied while it is in the cache. Runs start on a block's first row. Example, 2 ** 20
        values: fp8 in 128-row blocks with 7168 columns, runs of 128 rows (146 rounded down to whole blocks, at
        least one); with 2048 columns, 512 rows; INT4 with 7168 columns, 146 rows."""
        cell = self.format.row_cell
        step = max(cell, values // self.columns // cell * cell)
        buffer = torch.empty((step, self.columns), dtype=torch.float32, device=self.device)
        row = 0
        for segment, rows in self.segments.items():
            for expert in range(self.experts):
                parts = self._parts(segment, expert)
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    out = buffer[: stop - start]
                    self.format.expand_into(self.format.rows_of(parts, start, stop), out)
                    yield slice(row + start, row + stop), out.to(self.dtype)
                row += rows

    def _parts(self, segment: str | None, expert: int) -> dict[str, torch.Tensor]:
        """One expert's stored parts of one segment."""
        parts = {name: self.get_buffer(_buffer_name(segment, name)) for name in self.format.kept}
        return {name: part[expert] for name, part in parts.items()} if self.experts > 1 else parts


def _buffer_name(segment: str | None, part: str) -> str:
    return part if segment is None else f"{segment}_{part}"
