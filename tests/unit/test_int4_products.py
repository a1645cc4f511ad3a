"""What the CPU can check of the GPU's INT4 product (tandem.layers.int4_products): the nibble order tinygemm's packing
takes, and the (scale, zero) table through torch's CPU version of the kernel, which takes the same table and the
same (q - 8) * scale + zero. The GPU kernel itself: tests/cuda/test_int4_products.py."""

from __future__ import annotations

import torch

from tandem.layers.int4_products import GROUPS, applies, nibble_bytes, scales_and_zeros
from tandem.weights.formats import dequantize_packed_int4
from tests.helpers.quantized_checkpoints import pack_int4, quantize_int4


def test_each_byte_holds_an_even_column_high_and_the_next_low() -> None:
    q = torch.randint(-8, 8, (8, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    values = nibble_bytes(pack_int4(q))
    assert values.dtype == torch.uint8 and values.shape == (8, 128)
    assert torch.equal((values >> 4).to(torch.int8) - 8, q[:, 0::2])
    assert torch.equal((values & 0xF).to(torch.int8) - 8, q[:, 1::2])


def test_the_table_gives_the_dequantized_weight_through_torchs_cpu_kernel() -> None:
    generator = torch.Generator().manual_seed(1)
    rows, columns, group = 16, 256, 32
    q, scale = quantize_int4(torch.randn(rows, columns, generator=generator), group)
    table = scales_and_zeros(scale)
    assert table.shape == (columns // group, rows, 2) and table.dtype == torch.bfloat16
    # The CPU kernel packs [rows, columns] int32 values 0..15 (the GPU's packing takes nibble_bytes' pairs instead).
    tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 2)
    x = torch.randn(3, columns, generator=generator).to(torch.bfloat16)
    product = torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiled, group, table)
    weight = dequantize_packed_int4(pack_int4(q), scale, (rows, columns), group)
    expected = x.float() @ weight.t()
    assert (product.float() - expected).norm() / expected.norm() < 1e-2  # bfloat16 output


def test_where_the_kernel_applies() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not applies(cpu, torch.bfloat16, 32, (64, 256))
    assert not applies(cuda, torch.float32, 32, (64, 256))  # tinygemm takes bfloat16 activations
    assert not applies(cuda, torch.bfloat16, 16, (64, 256)) and 16 not in GROUPS
    assert not applies(cuda, torch.bfloat16, 32, (60, 256))  # rows: a multiple of 8
    assert not applies(cuda, torch.bfloat16, 32, (64, 192))  # columns: whole k-tiles of 128
    assert applies(cuda, torch.bfloat16, 32, (64, 256)) == hasattr(torch.ops.aten, "_weight_int4pack_mm")
