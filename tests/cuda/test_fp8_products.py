"""Block-wise fp8 weights on fp8 tensor cores (tandem.layers.fp8_products): torch._scaled_mm with 1x128 activation
groups and 128x128 weight blocks against the float32 emulation from the same fp8 values, and a stored weight on such
a GPU multiplied by it. Needs compute capability 9.x and a torch whose cuBLAS scales blocks (CUDA 12.9 or later)."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.fp8_products import GROUP, SCALED_MM_CAPABILITY, applies, emulated, scaled_block_mm
from tandem.layers.stored import StoredWeight
from tandem.weights.formats import BlockFp8
from tests.helpers.quantized_checkpoints import quantize_block_fp8

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != SCALED_MM_CAPABILITY[0],
        reason="cuBLAS block-scaled fp8 needs compute capability 9.x",
    ),
]


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_the_kernel_is_the_emulated_product(tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    fp8, scale_inv = quantize_block_fp8(torch.randn(512, 768, generator=generator) * 0.05, (GROUP, GROUP))
    x = torch.randn(tokens, 768, generator=generator).to(torch.bfloat16)
    fp8, scale_inv, x = fp8.cuda(), scale_inv.cuda(), x.cuda()
    product = scaled_block_mm(x, fp8, scale_inv)
    reference = emulated(x, fp8, scale_inv)
    assert product.dtype == torch.bfloat16 and product.shape == (tokens, 512)
    assert (product.float() - reference).norm() / reference.norm() < 1e-2  # bfloat16 output


def test_a_stored_fp8_weight_on_the_gpu_is_multiplied_as_stored() -> None:
    fp8, scale_inv = quantize_block_fp8(torch.randn(256, 384) * 0.05, (GROUP, GROUP))
    stored = StoredWeight(BlockFp8((GROUP, GROUP)), {"gate": 128, "up": 128}, 384, torch.bfloat16, "cuda")
    stored.load("gate", {"weight": fp8[:128], "weight_scale_inv": scale_inv[:1]})
    stored.load("up", {"weight": fp8[128:], "weight_scale_inv": scale_inv[1:]})
    assert applies(stored.device, (GROUP, GROUP), (128, 384))
    x = torch.randn(3, 384, device="cuda", dtype=torch.bfloat16)
    product = stored.kernel_product(x)
    assert product is not None
    reference = emulated(x, fp8.cuda(), scale_inv.cuda())
    assert (product.float() - reference).norm() / reference.norm() < 1e-2
