"""Multi-head attention with grouped KV heads over the paged KV cache (plain PyTorch backend).

Options used by some families: a softmax scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar), and a
sliding window, with which a query at position p sees only the keys at positions (p - sliding_window, p], itself
included (the Hugging Face rule). Example with sliding_window 3: the query at position 5 sees positions 3, 4 and 5.

Tensor parallel: each rank holds num_heads / tp query heads and num_kv_heads / tp KV heads (the q/k/v projection is
column parallel, so a rank's query heads and the KV heads they share stay together), attends over its own KV-cache
shard, and o_proj (row parallel) sums the ranks' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.kv_cache import AttentionMetadata, PagedKVCache
from tandem.layers.linear import PackedLinear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import RowParallelLinear


class Attention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        input_size: int,
        output_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
        qk_norm_unit_offset: bool = False,  # Gemma-style (1 + weight) q/k norms
        scaling: float | None = None,  # softmax scale; None means head_dim ** -0.5
        sliding_window: int | None = None,  # None: every earlier position is visible
        group: ParallelGroup = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = group.split(num_heads, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = group.split(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = PackedLinear(input_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias, group)
        self.o_proj = RowParallelLinear(q_size, output_size, o_bias, group)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_unit_offset) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps, qk_norm_unit_offset) if qk_norm_eps is not None else None
        self.rotary = rotary

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, input_size]
        metadata: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # -> [num_tokens, output_size]
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotary(metadata.positions, query, key)
        attended = paged_attention(
            query, key, value, cache, self.layer_index, metadata, self.scaling, self.sliding_window
        )
        return self.o_proj(attended.reshape(num_tokens, self.num_heads * self.head_dim))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache: PagedKVCache,
    layer_index: int,
    metadata: AttentionMetadata,
    scaling: float | None = None,  # softmax scale; None means head_dim ** -0.5
    sliding_window: int | None = None,  # see the module docstring
) -> torch.Tensor:  # -> [num_tokens, num_heads, head_dim]
    """Writes the new KV into the cache, then attends each sequence to its visible context."""
    layer_keys, layer_values = cache.keys[layer_index], cache.values[layer_index]
    layer_keys.index_copy_(0, metadata.write_slots, key.to(layer_keys.dtype))
    layer_values.index_copy_(0, metadata.write_slots, value.to(layer_values.dtype))
    output = torch.empty_like(query)
    for span in metadata.spans:
        rows = slice(span.query_start, span.query_start + span.query_len)
        if span.context_len == span.query_len:
            # Fresh sequence (prefill from position 0): its KV is exactly this step's keys and values.
            span_keys, span_values = key[rows], value[rows]
        else:
            span_keys = layer_keys.index_select(0, span.context_slots).to(query.dtype)
            span_values = layer_values.index_select(0, span.context_slots).to(query.dtype)
        query_offset = span.context_len - span.query_len
        output[rows] = _attend(query[rows], span_keys, span_values, query_offset, scaling, sliding_window)
    return output


def _attend(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    keys: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [context_len, num_kv_heads, head_dim]
    query_offset: int,  # position of the first query; query i may see keys [0, query_offset + i]
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:  # -> [query_len, num_heads, head_dim]
    query_len, context_len = query.shape[0], keys.shape[0]
    windowed = sliding_window is not None and context_len > sliding_window
    mask = None
    # One query at the end of the context sees every key unless a window cuts the start off: no mask needed.
    if query_len > 1 or windowed:
        # Bottom-right aligned causal mask: e.g. 2 queries over 5 keys -> row 0 sees keys 0..3, row 1 keys 0..4.
        key_index = torch.arange(context_len, device=query.device)
        query_position = torch.arange(query_len, device=query.device) + query_offset
        mask = key_index[None, :] <= query_position[:, None]  # [query_len, context_len]
        if sliding_window is not None:
            # With sliding_window 3 the same rows see keys 1..3 and 2..4.
            mask &= key_index[None, :] > query_position[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out.transpose(0, 1)
