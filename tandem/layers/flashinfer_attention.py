"""The FlashInfer attention backend (CUDA, bfloat16 or float16) over the same page table as the torch backend.

Not yet run on a GPU (docs/gpu.md). `flashinfer` is imported when this backend is built, never otherwise.

A step's `plan` keeps the page table; FlashInfer's wrappers are planned by the first layer that attends with a given
shape (heads, head_dim, scale, window, dtypes) and then run by every layer of that shape, so a model with two kinds
of layers (Gemma3's sliding and global ones) plans two wrappers a step. Which wrapper:

- every sequence adds one token (decoding, a verification without drafts): BatchDecodeWithPagedKVCacheWrapper;
- otherwise BatchPrefillWithPagedKVCacheWrapper: causal (FlashInfer aligns it bottom-right, as the torch backend
  does) or, when a tree is in the step, with a custom_mask for every sequence: its [query_len, kv_len] rows, flattened
  and concatenated in sequence order (a chain: key j visible to query i iff j <= start + i; a tree: the context
  columns, then the tree mask);
- MLA (`attend_latent`): BatchMLAPagedAttentionWrapper over the pool's rows split into the latent (ckv) and rope
  (kpe) columns, when the step has no tree and the sizes are the kernel's (latent 512, rope 64). Trees and other
  sizes go to the torch step, as does a sliding window on a step with a tree (FlashInfer's window counts KV rows,
  while a tree token's position is its depth).

CUDA graphs (tandem.layers.cuda_graphs): `graph_step` plans a step whose wrappers run in FlashInfer's CUDA-graph
mode, over index buffers of fixed addresses sized for one batch size (`GraphBuffers`), which each `replan` rewrites
for the next step of that shape; such a step takes no tree and no MLA (a recorded shape never has a tree, and an MLA
model's graphs fail to record and run eagerly).

FlashInfer's `window_left` w lets a query at position p see keys [p - w, p]; Tandem's window W sees (p - W, p], so
w = W - 1. New keys and values are written with index_copy_ into the pool viewed as [pages, page_size, heads, dim]
(FlashInfer's "NHD" layout), as in the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.layers.page_table import HOST, PageTable
from tandem.layers.torch_attention import TorchAttentionStep

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace, shared by every wrapper of one backend
MLA_LATENT_DIM, MLA_ROPE_DIM = 512, 64  # the sizes FlashInfer's MLA kernels are built for


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        import flashinfer  # the tandem[cuda] extra

        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend runs on CUDA devices, not {device}")
        self.flashinfer: Any = flashinfer
        self.device = device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict[Hashable, Any] = {}

    def wrapper(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The wrapper for one shape, made once and planned again by every step that uses it."""
        if key not in self._wrappers:
            self._wrappers[key] = make()
        return self._wrappers[key]

    def plan(self, page_table: PageTable) -> FlashInferStep:
        return FlashInferStep(self, page_table)

    def graph_step(self, page_table: PageTable, batch: int, num_pages: int) -> FlashInferStep:
        """A step for a recorded shape of `batch` sequences over a pool of `num_pages` pages (CUDA-graph mode)."""
        return FlashInferStep(self, page_table, GraphBuffers.sized(batch, num_pages, self.device))


@dataclass(frozen=True)
class GraphBuffers:
    """FlashInfer's index buffers for one recorded shape, at fixed addresses: its plans write them, its graph reads
    them."""

    qo_indptr: torch.Tensor  # [batch + 1] int32
    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indices: torch.Tensor  # [num_pages] int32, room for every page of the pool
    kv_last_page_len: torch.Tensor  # [batch] int32

    @classmethod
    def sized(cls, batch: int, num_pages: int, device: torch.device) -> GraphBuffers:
        def zeros(length: int) -> torch.Tensor:
            return torch.zeros(length, dtype=torch.int32, device=device)

        return cls(zeros(batch + 1), zeros(batch + 1), zeros(num_pages), zeros(batch))

    def decode_arguments(self) -> dict[str, torch.Tensor]:
        """The buffers as BatchDecodeWithPagedKVCacheWrapper's constructor names them (it takes no qo_indptr)."""
        return {
            "paged_kv_indptr_buffer": self.kv_indptr,
            "paged_kv_indices_buffer": self.kv_page_indices,
            "paged_kv_last_page_len_buffer": self.kv_last_page_len,
        }

    def prefill_arguments(self) -> dict[str, torch.Tensor]:
        """The buffers as BatchPrefillWithPagedKVCacheWrapper's constructor names them."""
        return {
            "qo_indptr_buf": self.qo_indptr,
            "paged_kv_indptr_buf": self.kv_indptr,
            "paged_kv_indices_buf": self.kv_page_indices,
            "paged_kv_last_page_len_buf": self.kv_last_page_len,
        }


class FlashInferStep:
    def __init__(self, backend: FlashInferBackend, page_table: PageTable, graph: GraphBuffers | None = None) -> None:
        self.backend = backend
        self.graph = graph
        self._planned: dict[tuple[Any, ...], Any] = {}  # a shape (see attend) -> its planned wrapper
        self._use(page_table)

    def replan(self, page_table: PageTable) -> None:
        """Plans every wrapper planned so far again, for the next step of a recorded shape (CUDA-graph mode)."""
        self._use(page_table)
        for shape in self._planned:
            self._planned[shape] = self._plan_attention(*shape)

    def _use(self, page_table: PageTable) -> None:
        self.table = page_table
        self.write_slots = page_table.write_slots  # [num_tokens] on the device
        query_lens, kv_lens = page_table.query_lens(), page_table.kv_lens()
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device=HOST)  # [batch] on the host, for the MLA planner
        self.has_tree = any(mask is not None for mask in page_table.custom_masks)
        self.decoding = not self.has_tree and all(length == 1 for length in query_lens)
        self.custom_mask = self._packed_mask(query_lens, kv_lens) if self.has_tree else None
        self._torch: TorchAttentionStep | None = None
        if self.graph is not None and self.has_tree:
            raise ValueError("a recorded (CUDA-graph) step takes no tree")

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        layer_keys: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        layer_values: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        scaling: float | None,
        sliding_window: int | None,
    ) -> torch.Tensor:  # -> [num_tokens, num_heads, head_dim]
        if self.has_tree and sliding_window is not None:
            return self._torch_step().attend(query, key, value, layer_keys, layer_values, scaling, sliding_window)
        layer_keys.index_copy_(0, self.write_slots, key.to(layer_keys.dtype))
        layer_values.index_copy_(0, self.write_slots, value.to(layer_values.dtype))
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = layer_keys.shape[1]
        scale = scaling if scaling is not None else head_dim**-0.5
        window_left = -1 if sliding_window is None else sliding_window - 1
        shape = (num_heads, num_kv_heads, head_dim, scale, window_left, query.dtype, layer_keys.dtype)
        wrapper = self._planned_wrapper(shape, lambda: self._plan_attention(*shape))
        page_size = self.table.page_size
        pages = (
            layer_keys.view(-1, page_size, num_kv_heads, head_dim),
            layer_values.view(-1, page_size, num_kv_heads, head_dim),
        )  # [num_pages, page_size, num_kv_heads, head_dim] each
        return wrapper.run(query, pages)

    def attend_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, row_dim]
        rows: torch.Tensor,  # [num_tokens, 1, row_dim]
        layer_rows: torch.Tensor,  # [num_slots, 1, row_dim]
        latent_dim: int,
        scaling: float,
    ) -> torch.Tensor:  # -> [num_tokens, num_heads, latent_dim]
        if self.graph is not None:
            raise ValueError("MLA attention is not recorded in CUDA graphs")
        row_dim = layer_rows.shape[-1]
        if self.has_tree or (latent_dim, row_dim - latent_dim) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
            return self._torch_step().attend_latent(query, rows, layer_rows, latent_dim, scaling)
        layer_rows.index_copy_(0, self.write_slots, rows.to(layer_rows.dtype))
        shape = ("mla", query.shape[1], scaling, query.dtype, layer_rows.dtype)
        wrapper = self._planned_wrapper(
            shape, lambda: self._plan_latent(query.shape[1], scaling, query.dtype, layer_rows.dtype)
        )
        pages = layer_rows.view(-1, self.table.page_size, row_dim)  # [num_pages, page_size, row_dim]
        return wrapper.run(
            query[..., :latent_dim], query[..., latent_dim:], pages[..., :latent_dim], pages[..., latent_dim:]
        )

    def _plan_attention(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window_left: int,
        query_dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> Any:
        """The decode or prefill wrapper of one shape (module docstring), planned for this step's page table."""
        flashinfer, table = self.backend.flashinfer, self.table
        key = (num_heads, num_kv_heads, head_dim, scale, window_left, query_dtype, kv_dtype)
        common = {"sm_scale": scale, "window_left": window_left, "q_data_type": query_dtype, "kv_data_type": kv_dtype}
        # The paged KV arguments both wrappers' plan takes, in this order.
        paged = (
            table.kv_indptr,
            table.kv_page_indices,
            table.kv_last_page_len,
            num_heads,
            num_kv_heads,
            head_dim,
            table.page_size,
        )
        if self.decoding:
            wrapper = self._paged_wrapper(
                ("decode", *key), key, flashinfer.BatchDecodeWithPagedKVCacheWrapper, GraphBuffers.decode_arguments
            )
            wrapper.plan(*paged, **common)
            return wrapper
        wrapper = self._paged_wrapper(
            # Masked and causal plans apart: a step planned without images' spans runs beside the one with them.
            ("prefill", self.custom_mask is not None, *key),
            key,
            flashinfer.BatchPrefillWithPagedKVCacheWrapper,
            GraphBuffers.prefill_arguments,
        )
        mask = self.custom_mask
        wrapper.plan(table.qo_indptr, *paged, custom_mask=mask, causal=mask is None, **common)
        return wrapper

    def _paged_wrapper(
        self,
        backend_key: Hashable,
        key: tuple[Any, ...],  # the shape, as _planned keys it
        wrapper_class: Any,  # FlashInfer's decode or prefill wrapper class
        graph_arguments: Callable[[GraphBuffers], dict[str, torch.Tensor]],  # its constructor's buffer arguments
    ) -> Any:
        """An eager step's wrapper is the backend's, shared by every step of the shape; a recorded step has its own,
        over its fixed buffers, made by its first plan and planned again by every replan."""
        workspace, graph = self.backend.workspace, self.graph
        if graph is None:
            return self.backend.wrapper(backend_key, lambda: wrapper_class(workspace, "NHD"))
        return self._planned.get(key) or wrapper_class(workspace, "NHD", use_cuda_graph=True, **graph_arguments(graph))

    def _planned_wrapper(self, shape: tuple[Any, ...], plan: Callable[[], Any]) -> Any:
        """The wrapper this step planned for `shape`: planned by the first layer of the step that attends with it,
        then run by every other."""
        wrapper = self._planned.get(shape)
        if wrapper is None:
            wrapper = plan()
            self._planned[shape] = wrapper
        return wrapper

    def _plan_latent(self, num_heads: int, scale: float, query_dtype: torch.dtype, kv_dtype: torch.dtype) -> Any:
        flashinfer, table, workspace = self.backend.flashinfer, self.table, self.backend.workspace
        wrapper = self.backend.wrapper(
            ("mla", num_heads, scale, query_dtype, kv_dtype),
            lambda: flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace),
        )
        wrapper.plan(
            table.qo_indptr,
            table.kv_indptr,
            table.kv_page_indices,
            self.kv_lens,
            num_heads,
            MLA_LATENT_DIM,
            MLA_ROPE_DIM,
            table.page_size,
            True,  # causal, bottom-right aligned
            scale,
            query_dtype,
            kv_dtype,
        )
        return wrapper

    def _packed_mask(self, query_lens: list[int], kv_lens: list[int]) -> torch.Tensor:  # -> [sum q * kv] bool
        """Every sequence's [query_len, kv_len] mask, flattened row by row and concatenated (see the docstring)."""
        parts = []
        for query_len, kv_len, tree in zip(query_lens, kv_lens, self.table.custom_masks, strict=True):
            start = kv_len - query_len
            if tree is None:
                keys = torch.arange(kv_len, device=HOST)
                mask = keys[None, :] <= start + torch.arange(query_len, device=HOST)[:, None]
            else:
                mask = torch.cat((torch.ones((query_len, start), dtype=torch.bool, device=HOST), tree), dim=1)
            parts.append(mask.flatten())
        return torch.cat(parts).to(self.backend.device)

    def _torch_step(self) -> TorchAttentionStep:
        if self._torch is None:
            self._torch = TorchAttentionStep(self.table)
        return self._torch
