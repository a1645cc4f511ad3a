"""The parts of the fp8 tensor-core product (tandem.layers.fp8_products) that run on the CPU: the activations'
quantization in groups of 128 columns, the float32 emulation of the product the CUDA tests check the kernel against,
and that the CPU never takes the tensor cores' path."""

from __future__ import annotations

import torch

from tandem.layers.fp8_products import E4M3_MAX, GROUP, applies, emulated, quantize_activations
from tandem.layers.stored import StoredWeight
from tandem.weights.formats import BlockFp8
from tests.helpers.quantized_checkpoints import quantize_block_fp8


def test_activations_are_quantized_per_token_in_groups_of_128_columns() -> None:
    x = torch.randn(3, 2 * GROUP, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [1e-3], [50.0]])
    x[1, GROUP:] = 0.0  # an all-zero group
    values, multipliers = quantize_activations(x)
    assert values.dtype == torch.float8_e4m3fn and multipliers.shape == (3, 2)
    restored = values.float() * multipliers.repeat_interleave(GROUP, dim=1)
    # e4m3 keeps 3 bits of mantissa: each value within 1/16 of itself, and each group's largest lands on 448.
    assert torch.all((restored - x).abs() <= x.abs() / 16 + 1e-12)
    largest = values.float().view(3, 2, GROUP).abs().amax(dim=-1)
    assert largest[1, 1] == 0.0 and multipliers[1, 1] == 1.0
    assert torch.equal(largest[largest > 0], torch.full_like(largest[largest > 0], E4M3_MAX))


def test_the_emulated_product_is_the_float_product_to_fp8_rounding() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 384, generator=generator) * 0.05
    fp8, scale_inv = quantize_block_fp8(weight, (GROUP, GROUP))
    dequantized = fp8.float() * scale_inv.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)
    x = torch.randn(5, 384, generator=generator)
    product = emulated(x, fp8, scale_inv)
    exact = x @ dequantized.t()
    assert product.shape == (5, 256)
    assert (product - exact).norm() / exact.norm() < 0.05  # the activations' rounding alone
    assert torch.equal(emulated(x, fp8, scale_inv), product)


def test_the_cpu_takes_another_product() -> None:
    assert not applies(torch.device("cpu"), (GROUP, GROUP), (256, 384))
    stored = StoredWeight(BlockFp8((GROUP, GROUP)), {None: 256}, 384, torch.float32, "cpu")
    fp8, scale_inv = quantize_block_fp8(torch.randn(256, 384), (GROUP, GROUP))
    stored.load(None, {"weight": fp8, "weight_scale_inv": scale_inv})
    assert stored.kernel_product(torch.randn(16, 384)) is None  # 16 rows: expanded run by run (test_cpu_products)
