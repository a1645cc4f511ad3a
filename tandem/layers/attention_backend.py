"""The attention backend seam: how a step's planned page table becomes attention in every layer.

A backend is chosen when a KV cache is built (`PagedKVCache(..., backend=...)`). Once per step the cache's planner
builds the `PageTable` (tandem.layers.page_table) and hands it to `backend.plan`, which does whatever per-step work
the backend needs (the torch backend: gather indices and masks) and returns an `AttentionStep`. Every attention
layer then calls that step through the metadata: `metadata.attention.attend(...)` for grouped-query attention,
`metadata.attention.attend_latent(...)` for MLA. Both write the new tokens' KV into the layer's pool first.

Backends by name are in `ATTENTION_BACKENDS`; `default_backend(device, dtype)` picks one for a cache. The torch
(SDPA) backend runs everywhere; the FlashInfer backend (tandem.layers.flashinfer_attention, CUDA only, bfloat16 or
float16) is imported only when it is asked for, and is the default on CUDA when the package is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.layers.page_table import PageTable
from tandem.layers.torch_attention import TorchAttentionBackend


class AttentionStep(Protocol):
    """One step's attention, planned; called by every layer of the step."""

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] the new tokens' keys
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_keys: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] this layer's pool
        layer_values: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        scaling: float | None,  # softmax scale; None: head_dim ** -0.5
        sliding_window: int | None,  # a query at position p sees key positions (p - window, p]; None: all
    ) -> torch.Tensor: ...  # -> [num_tokens, num_heads, head_dim]

    def attend_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, row_dim] query in the latent space (MLA, absorbed)
        rows: torch.Tensor,  # [num_tokens, 1, row_dim] the new tokens' cache rows: latent then rope key
        layer_rows: torch.Tensor,  # [num_slots, 1, row_dim] this layer's pool
        latent_dim: int,  # the first latent_dim columns of a row are its value
        scaling: float,
    ) -> torch.Tensor: ...  # -> [num_tokens, num_heads, latent_dim]


class AttentionBackend(Protocol):
    name: str

    def plan(self, page_table: PageTable) -> AttentionStep: ...


@dataclass(frozen=True)
class AttentionMetadata:
    """What a model's forward takes: the step's page table and the backend's plan of it."""

    page_table: PageTable
    attention: AttentionStep
    causal: AttentionMetadata | None = None  # the step planned without images' spans; None: it has none

    @classmethod
    def planned(cls, page_table: PageTable, backend: AttentionBackend) -> AttentionMetadata:
        plain = page_table.without_spans()
        causal = None if plain is page_table else cls(plain, backend.plan(plain))
        return cls(page_table, backend.plan(page_table), causal)

    def without_spans(self) -> AttentionMetadata:
        """This step with images' tokens attending causally (PageTable.without_spans)."""
        return self if self.causal is None else self.causal

    @property
    def positions(self) -> torch.Tensor:  # [num_tokens]
        return self.page_table.positions


def _flashinfer(device: torch.device) -> AttentionBackend:
    from tandem.layers.flashinfer_attention import FlashInferBackend  # imports flashinfer: CUDA only

    return FlashInferBackend(device)


# name -> a backend for a cache on that device.
ATTENTION_BACKENDS: dict[str, Callable[[torch.device], AttentionBackend]] = {
    "torch": lambda device: TorchAttentionBackend(),
    "flashinfer": _flashinfer,
}


def default_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend a cache uses unless it is given one: FlashInfer on CUDA in 16 bits when installed, else torch."""
    from tandem.devices import flashinfer_installed

    fits = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return ATTENTION_BACKENDS["flashinfer" if fits and flashinfer_installed() else "torch"](device)


def backend_named(name: str | None, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend `name` (None: default_backend) for a cache on `device`; raises ValueError for an unknown name."""
    if name is None:
        return default_backend(device, dtype)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](device)
