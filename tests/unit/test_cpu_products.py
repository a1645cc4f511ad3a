"""The fused CPU products with weights kept as stored (tandem.layers.cpu_products) against the dequantized weight's
product, and where StoredWeight runs them."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.cpu_products import MAX_ROWS, applies, fp8_product, int4_applies, int4_product
from tandem.layers.stored import StoredWeight
from tandem.weights.formats import BlockFp8, PackedInt4, dequantize_block_fp8, dequantize_packed_int4
from tests.helpers.quantized_checkpoints import pack_int4, quantize_block_fp8, quantize_int4


def assert_float32_product(product: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """product is x @ weight^T up to float32 rounding in any order of the sums: within columns * 2 ** -23 of the
    sum of the terms' magnitudes, against the float64 product."""
    exact = x.double() @ weight.double().t()
    bound = x.shape[1] * 2.0**-23 * (x.double().abs() @ weight.double().abs().t())
    assert product.dtype == torch.float32 and product.shape == exact.shape
    assert torch.all((product.double() - exact).abs() <= bound + 1e-30)


@pytest.mark.parametrize(("shape", "block"), [((256, 384), (128, 128)), ((40, 72), (16, 32)), ((7, 5), (4, 4))])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_fp8_product_is_the_dequantized_product(shape: tuple[int, int], block: tuple[int, int], rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    codes[(codes & 0x7F) == 0x7F] = 0x01  # no NaN codes; 0x01 and 0x81 are e4m3's smallest subnormals
    codes[0, :2] = torch.tensor([0x01, 0x87], dtype=torch.uint8)  # subnormals present whatever the draw
    weight = codes.view(torch.float8_e4m3fn)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(grid, generator=generator) * 1e-3 + 5e-4
    scale_inv[0, 0] = 300.0  # a scale far above a release's, next to small ones
    x = torch.randn(rows, shape[1], generator=generator) * torch.logspace(-3, 4, shape[1])  # activations of all sizes
    assert_float32_product(fp8_product(x, weight, scale_inv, block), x, dequantize_block_fp8(weight, scale_inv, block))


@pytest.mark.parametrize(("shape", "group"), [((64, 96), 32), ((9, 20), 4), ((12, 128), 128)])
@pytest.mark.parametrize("rows", [1, MAX_ROWS])
def test_int4_product_is_the_dequantized_product(shape: tuple[int, int], group: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    q, scale = quantize_int4(torch.randn(shape, generator=generator), group)
    packed = pack_int4(q)  # 20 columns: the last word half padding
    x = torch.randn(rows, shape[1], generator=generator)
    expected = dequantize_packed_int4(packed, scale, shape, group)
    assert_float32_product(int4_product(x, packed, scale, group), x, expected)


def test_what_the_kernels_take() -> None:
    assert applies(torch.randn(MAX_ROWS, 8)) and not applies(torch.randn(MAX_ROWS + 1, 8))
    assert not applies(torch.randn(1, 8, dtype=torch.bfloat16)) and not applies(torch.randn(0, 8))
    assert int4_applies(32) and int4_applies(2) and not int4_applies(48) and not int4_applies(1)


def test_a_stored_weight_takes_the_fused_product_for_a_few_rows() -> None:
    stored = StoredWeight(BlockFp8((128, 128)), {"gate": 256, "up": 128}, 384, torch.float32, "cpu")
    parts = {}
    for segment, rows in stored.segments.items():
        fp8, scale_inv = quantize_block_fp8(torch.randn(rows, 384), (128, 128))
        stored.load(segment, {"weight": fp8, "weight_scale_inv": scale_inv})
        parts[segment] = dequantize_block_fp8(fp8, scale_inv, (128, 128))
    weight = torch.cat(list(parts.values()))
    x = torch.randn(2, 3, 384)  # [..., in]: two sequences of three tokens
    product = stored.kernel_product(x)
    assert product is not None and product.shape == (2, 3, 384)
    assert_float32_product(product.view(6, -1), x.view(6, -1), weight)
    assert stored.kernel_product(torch.randn(MAX_ROWS + 1, 384)) is None  # expanded run by run instead


def test_an_int4_weight_of_other_groups_is_expanded() -> None:
    stored = StoredWeight(PackedInt4(group_size=24), {None: 4}, 48, torch.float32, "cpu")
    q, scale = quantize_int4(torch.randn(4, 48), 24)
    stored.load(None, {"weight_packed": pack_int4(q), "weight_scale": scale})
    assert stored.kernel_product(torch.randn(1, 48)) is None
