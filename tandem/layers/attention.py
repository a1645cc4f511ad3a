"""Multi-head attention with grouped KV heads over the paged KV cache, through the step's attention backend
(tandem.layers.attention_backend).

Options used by some families: a softmax scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar), a
sliding window, with which a query at position p sees only the keys at positions (p - sliding_window, p], itself
included (the Hugging Face rule; example with sliding_window 3: the query at position 5 sees positions 3, 4 and 5),
and a head-wise output gate (Step-3.5's g_proj): one more projection of the input gives one value per query head,
and each head's attention output is multiplied by sigmoid(that value) before o_proj. The gate is a fourth part of
the packed q/k/v projection ("g", num_heads rows), split across ranks with its heads.

Tensor parallel: each rank holds num_heads / tp query heads and num_kv_heads / tp KV heads (the q/k/v projection is
column parallel, so a rank's query heads and the KV heads they share stay together), attends over its own KV-cache
shard, and o_proj (row parallel) sums the ranks' outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache
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
        output_gate: bool = False,  # the head-wise sigmoid gate above
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = group.split(num_heads, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = group.split(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        parts = {"q": q_size, "k": kv_size, "v": kv_size} | ({"g": num_heads} if output_gate else {})
        self.qkv_proj = PackedLinear(input_size, parts, qkv_bias, group)
        self.output_gate = output_gate
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
        query, key, value, packed = self.project(hidden, metadata.positions)
        attended = metadata.attention.attend(
            query,
            key,
            value,
            cache.keys[self.layer_index],
            cache.values[self.layer_index],
            self.scaling,
            self.sliding_window,
        )
        return self.output(attended, packed)

    def project(
        self,
        hidden: torch.Tensor,  # [num_tokens, input_size]
        positions: torch.Tensor,  # [num_tokens]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # -> query, key, value, packed projection
        """Queries, keys and values of the tokens, normed and rotated: [num_tokens, heads, head_dim] each."""
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        packed = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size (+ num_heads with the gate)]
        value = packed[:, q_size + kv_size : q_size + 2 * kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query = self.q_norm(packed[:, :q_size].view(num_tokens, self.num_heads, self.head_dim))
            key = self.k_norm(packed[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            query, key = self.rotary(positions, query, key)
        else:
            # Query and key heads sit side by side in the packed projection: one rotation turns them all.
            heads = packed[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            rotated = self.rotary.rotate(positions, heads)
            query, key = rotated[:, : self.num_heads], rotated[:, self.num_heads :]
        return query, key, value, packed

    def output(
        self,
        attended: torch.Tensor,  # [rows, num_heads, head_dim]
        packed: torch.Tensor,  # [rows, ...] those rows of the packed projection (for the gate)
    ) -> torch.Tensor:  # -> [rows, output_size]
        if self.output_gate:
            value_end = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            attended = attended * packed[:, value_end:, None].sigmoid()  # gate: [rows, num_heads, 1]
        return self.o_proj(attended.reshape(attended.shape[0], self.num_heads * self.head_dim))
