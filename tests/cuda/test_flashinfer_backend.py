"""The FlashInfer backend against the torch backend on the same page tables, within bfloat16 tolerance."""

from __future__ import annotations

import pytest
import torch

from tandem.devices import flashinfer_installed
from tandem.layers.attention_backend import backend_named
from tandem.layers.kv_cache import PagedKVCache, SequenceKV

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed (pip install 'tandem[cuda]')"),
]

DEVICE = torch.device("cuda:0")
DTYPE = torch.bfloat16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 128, 16


def caches(num_kv_heads: int, head_dim: int, value_dim: int | None = None) -> list[PagedKVCache]:
    return [
        PagedKVCache(
            1, 64, PAGE_SIZE, num_kv_heads, head_dim, DTYPE, DEVICE, value_dim, backend_named(name, DEVICE, DTYPE)
        )
        for name in ("torch", "flashinfer")
    ]


# Per step: (new tokens per sequence, parents per sequence or None). Sequences persist from step to step.
STEPS = [
    ([37, 5, 20], None),  # prefills of several pages
    ([1, 1, 1], None),  # decoding
    ([4, 1, 6], None),  # chains of drafts beside a decode
    ([4, 1, 3], [[-1, 0, 0, 1], None, [-1, 0, 1]]),  # trees beside a decode
]


@pytest.mark.parametrize("window", [None, 8])
def test_attention_matches_the_torch_backend(window: int | None) -> None:
    generator = torch.Generator(device="cpu").manual_seed(0)
    torch_cache, flashinfer_cache = caches(NUM_KV_HEADS, HEAD_DIM)
    sequences = [[SequenceKV() for _ in range(3)] for _ in range(2)]
    for new, parents in STEPS:
        if parents is not None and window is not None:
            continue  # trees with a window run the torch step on both: nothing to compare
        total = sum(new)
        query = torch.randn(total, NUM_HEADS, HEAD_DIM, generator=generator).to(DEVICE, DTYPE)
        key = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE, DTYPE)
        value = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(DEVICE, DTYPE)
        outputs = []
        for cache, own in zip((torch_cache, flashinfer_cache), sequences, strict=True):
            metadata = cache.plan(list(zip(own, new, strict=True)), parents)
            outputs.append(metadata.attention.attend(query, key, value, cache.keys[0], cache.values[0], None, window))
        torch.testing.assert_close(outputs[1].float(), outputs[0].float(), rtol=2e-2, atol=2e-2)


def test_latent_attention_matches_the_torch_backend() -> None:
    generator = torch.Generator(device="cpu").manual_seed(1)
    row_dim, latent_dim = 512 + 64, 512
    torch_cache, flashinfer_cache = caches(1, row_dim, value_dim=0)
    sequences = [[SequenceKV() for _ in range(2)] for _ in range(2)]
    for new in ([30, 9], [1, 1], [5, 1]):
        total = sum(new)
        query = torch.randn(total, 16, row_dim, generator=generator).to(DEVICE, DTYPE)
        rows = torch.randn(total, 1, row_dim, generator=generator).to(DEVICE, DTYPE)
        outputs = []
        for cache, own in zip((torch_cache, flashinfer_cache), sequences, strict=True):
            metadata = cache.plan(list(zip(own, new, strict=True)))
            outputs.append(metadata.attention.attend_latent(query, rows, cache.keys[0], latent_dim, row_dim**-0.5))
        torch.testing.assert_close(outputs[1].float(), outputs[0].float(), rtol=2e-2, atol=2e-2)
