"""Group-wise INT4 weights by torch's tinygemm kernel (tandem.layers.int4_products) against the dequantized weight's
product, through a stored weight repacked at load on the GPU."""

from __future__ import annotations

import pytest
import torch

from tandem.layers.int4_products import PACKED_PARTS
from tandem.layers.stored import StoredWeight
from tandem.weights.formats import PackedInt4, dequantize_packed_int4
from tests.helpers.quantized_checkpoints import pack_int4, quantize_int4

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_a_stored_int4_weight_on_the_gpu_is_repacked_and_multiplied_by_tinygemm(tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    group, columns = 32, 512
    stored = StoredWeight(PackedInt4(group), {"gate": 128, "up": 64}, columns, torch.bfloat16, "cuda")
    weights = []
    for segment, rows in stored.segments.items():
        q, scale = quantize_int4(torch.randn(rows, columns, generator=generator), group)
        stored.load(segment, {"weight_packed": pack_int4(q), "weight_scale": scale})
        weights.append(dequantize_packed_int4(pack_int4(q), scale, (rows, columns), group))
    assert {name.split("_", 1)[1] for name, _ in stored.named_buffers()} == set(PACKED_PARTS)
    x = torch.randn(tokens, columns, generator=generator).to(torch.bfloat16)
    product = stored.kernel_product(x.cuda())
    expected = x.float() @ torch.cat(weights).t()
    assert product is not None and product.dtype == torch.bfloat16 and product.shape == (tokens, 192)
    assert (product.float().cpu() - expected).norm() / expected.norm() < 1e-2
    expanded = stored.expanded()  # the identity's product: the weight, rounded to bfloat16
    assert (expanded.float().cpu() - torch.cat(weights)).abs().max() <= torch.cat(weights).abs().max() / 128
