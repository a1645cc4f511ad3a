"""The plain PyTorch attention backend: each sequence's context gathered from its pages, then SDPA.

Its plan, once per step, turns the page table into what every layer reuses: per sequence its rows of the packed
batch, the pool slot of every KV row it sees (from its page indices: row r is slot `page[r // page_size] *
page_size + r % page_size`), and its mask. Masks are bottom-right aligned causal for chains (2 queries over 5 keys:
row 0 sees keys 0..3, row 1 keys 0..4), the context plus the tree mask for trees, and None where every key is
visible (one query at the end of its context). A sliding window adds, per window size, `key position > query
position - window`; those masks are built by the first layer that asks for that window and kept for the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.layers.page_table import PageTable


@dataclass(frozen=True)
class _SequencePlan:
    rows: slice  # its query rows of the packed batch
    start: int  # KV rows before its new tokens
    # [kv_len] pool slot of every KV row it sees; None: fresh (start == 0), or read as context_range
    context_slots: torch.Tensor | None
    # The same slots as one range of the pool when its pages follow each other (the pool hands out blocks in
    # order, so a lone request's usually do): its context is then a view of the pool, not a gathered copy.
    context_range: slice | None
    mask: torch.Tensor | None  # [query_len, kv_len] bool; None: every key visible
    tree: bool


class TorchAttentionStep:
    def __init__(self, page_table: PageTable) -> None:
        device = page_table.positions.device
        page_size = page_table.page_size
        pages = page_table.kv_page_indices.long()  # on the host, like the other index tensors
        offsets = torch.arange(page_size, dtype=torch.long, device=pages.device)
        page_bounds = page_table.kv_indptr.tolist()
        self.write_slots = page_table.write_slots
        self.positions = page_table.positions
        self.sequences: list[_SequencePlan] = []
        for index, (rows, kv_len) in enumerate(zip(page_table.query_slices(), page_table.kv_lens(), strict=True)):
            query_len = rows.stop - rows.start
            start = kv_len - query_len
            tree_mask = page_table.custom_masks[index]
            context_slots, context_range = None, None
            if start > 0:
                own_pages = pages[page_bounds[index] : page_bounds[index + 1]]
                first, count = int(own_pages[0]), len(own_pages)
                if own_pages.tolist() == list(range(first, first + count)):
                    context_range = slice(first * page_size, first * page_size + kv_len)
                else:
                    context_slots = (own_pages[:, None] * page_size + offsets).flatten()[:kv_len].to(device)
            mask = None
            if tree_mask is not None:
                seen_context = torch.ones((query_len, start), dtype=torch.bool, device=device)
                mask = torch.cat((seen_context, tree_mask.to(device)), dim=1)
            elif query_len > 1:
                key_index = torch.arange(kv_len, device=device)
                query_row = torch.arange(start, kv_len, device=device)
                mask = key_index[None, :] <= query_row[:, None]
            self.sequences.append(_SequencePlan(rows, start, context_slots, context_range, mask, tree_mask is not None))
        self._windowed_masks: dict[int, list[torch.Tensor | None]] = {}

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
        layer_keys.index_copy_(0, self.write_slots, _as(key, layer_keys.dtype))
        layer_values.index_copy_(0, self.write_slots, _as(value, layer_values.dtype))
        masks = self._masks(sliding_window)
        if len(self.sequences) == 1:  # no packing: attend straight into the output
            keys, values = self._context(self.sequences[0], key, value, layer_keys, layer_values)
            return _attend(query, keys, values, masks[0], scaling)
        output = torch.empty_like(query)
        for sequence, mask in zip(self.sequences, masks, strict=True):
            keys, values = self._context(sequence, key, value, layer_keys, layer_values)
            output[sequence.rows] = _attend(query[sequence.rows], keys, values, mask, scaling)
        return output

    def attend_latent(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, row_dim]
        rows: torch.Tensor,  # [num_tokens, 1, row_dim]
        layer_rows: torch.Tensor,  # [num_slots, 1, row_dim]
        latent_dim: int,
        scaling: float,
    ) -> torch.Tensor:  # -> [num_tokens, num_heads, latent_dim]
        layer_rows.index_copy_(0, self.write_slots, _as(rows, layer_rows.dtype))
        output = query.new_empty(query.shape[0], query.shape[1], latent_dim)
        for sequence in self.sequences:
            if sequence.context_range is not None:
                context = _as(layer_rows[sequence.context_range], query.dtype)
            elif sequence.context_slots is None:
                context = rows[sequence.rows]
            else:
                context = _as(layer_rows.index_select(0, sequence.context_slots), query.dtype)
            output[sequence.rows] = _attend(
                query[sequence.rows], context, context[..., :latent_dim], sequence.mask, scaling
            )
        return output

    def _context(
        self,
        sequence: _SequencePlan,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        layer_keys: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
        layer_values: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> keys, values [kv_len, num_kv_heads, head_dim]
        if sequence.context_range is not None:
            return _as(layer_keys[sequence.context_range], key.dtype), _as(
                layer_values[sequence.context_range], value.dtype
            )
        if sequence.context_slots is None:
            # Fresh sequence (prefill from position 0): its KV is exactly this step's keys and values.
            return key[sequence.rows], value[sequence.rows]
        keys = _as(layer_keys.index_select(0, sequence.context_slots), key.dtype)
        return keys, _as(layer_values.index_select(0, sequence.context_slots), value.dtype)

    def _masks(self, sliding_window: int | None) -> list[torch.Tensor | None]:
        if sliding_window is None:
            return [sequence.mask for sequence in self.sequences]
        masks = self._windowed_masks.get(sliding_window)
        if masks is None:
            masks = [self._windowed(sequence, sliding_window) for sequence in self.sequences]
            self._windowed_masks[sliding_window] = masks
        return masks

    def _windowed(self, sequence: _SequencePlan, sliding_window: int) -> torch.Tensor | None:
        query_positions = self.positions[sequence.rows]  # [query_len]
        query_len = query_positions.shape[0]
        kv_len = sequence.start + query_len
        if kv_len <= sliding_window:
            return sequence.mask  # every position is within the window of every query
        device = query_positions.device
        key_positions = torch.arange(kv_len, device=device)
        if sequence.tree:  # a tree token's position is its depth past the context, not its KV row
            key_positions[sequence.start :] = query_positions
        # With sliding_window 3 the chain rows of the module docstring see keys 1..3 and 2..4.
        within = key_positions[None, :] > query_positions[:, None] - sliding_window
        return within if sequence.mask is None else within & sequence.mask


class TorchAttentionBackend:
    name = "torch"

    def plan(self, page_table: PageTable) -> TorchAttentionStep:
        return TorchAttentionStep(page_table)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor in dtype; a tensor already in it is returned without a call into torch (this runs per layer)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


# The kernels asked for on CUDA when every key is visible: all but cuDNN's. cuDNN's SDPA builds an execution plan for
# each new shape, about 2 ms of CPU a call on an H200 with torch 2.11, and a context grows by a token a step, so an
# 8B-shaped target-only step at batch 1 spent 57 ms where the flash kernel takes 19 (median of 10 interleaved pairs,
# docs/gpu.md). With a mask the default choice stays: there the rest would fall back to the math kernel, and at
# batch 8 and 32 that was about twice as slow as cuDNN.
_UNMASKED_CUDA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attend(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    keys: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [kv_len, num_kv_heads, value_dim]
    mask: torch.Tensor | None,  # [query_len, kv_len] bool; None: all visible
    scaling: float | None,
) -> torch.Tensor:  # -> [query_len, num_heads, value_dim]
    # A batch dimension of 1: with 4-d inputs PyTorch's CPU kernel takes its fused (flash) path; 3-d inputs fall
    # back to the unfused math path, two to three times slower for a few query rows over a few hundred keys.
    arguments = (query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
    if mask is None and query.is_cuda:
        with sdpa_kernel(_UNMASKED_CUDA):
            out = F.scaled_dot_product_attention(*arguments, scale=scaling, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(*arguments, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)  # [1, num_heads, query_len, value_dim] -> [query_len, num_heads, value_dim]
