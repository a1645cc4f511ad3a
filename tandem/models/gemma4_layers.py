"""The blocks of a Gemma 4 layer that no other family has: its attention and its mixture of experts.

Attention (`Gemma4Attention`), per layer as its `Gemma4LayerSpec` says:
- q and k are RMS-normalised per head (plain weight * normed), v without any weight; the softmax scale is 1;
- a full layer with `values_from_keys` (attention_k_eq_v) has no v_proj: V = v_norm(k_proj(x)), taken before k_norm
  and the rotation;
- a KV-shared layer has only q_proj, q_norm and o_proj: it attends over the KV cache of its store layer
  (`kv_source`), whose keys and values for this step's tokens it takes from `produced`, the dict the store layer put
  them in earlier in the same forward (they are written again into the same slots, which changes nothing);
- the layer's K/V heads live in the first num_kv_heads * head_dim columns of the cache's rows (`layer_view`): the
  cache has one row width for every layer (tandem.models.gemma4_config.kv_row_layout).

Mixture of experts (`Gemma4Router`, `Gemma4Experts`): a softmax router over a weightless-normed, scaled copy of the
pre-MLP residual stream chooses top_k experts, renormalises their probabilities to sum to 1 and multiplies each by its
expert's `per_expert_scale`. Each expert is a gated MLP whose gate and up rows are stacked in one tensor per layer
(experts.gate_up_proj [E, 2 * I, H], experts.down_proj [E, H, I]). Tensor parallel splits the experts, not their
units: rank r holds experts [r * E / tp, (r + 1) * E / tp), runs those that tokens chose, and an all-reduce sums the
ranks' outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache
from tandem.layers.linear import PackedLinear
from tandem.layers.matmul import Linear
from tandem.layers.mlp import ACTIVATIONS
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.gemma4_config import Gemma4Config, Gemma4MoEConfig
from tandem.parallel.group import ParallelGroup, all_reduce
from tandem.parallel.layers import RowParallelLinear, ShardSpec

# Keys and values of this step's tokens that each K/V-keeping layer computed, by layer index, for the KV-shared layers
# later in the same forward: [num_tokens, num_kv_heads, head_dim] each, keys rotated, values normed.
ProducedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


def rms_normalize(hidden: torch.Tensor, eps: float) -> torch.Tensor:  # [..., size] -> [..., size]
    """RMS normalisation without a weight (Gemma 4's v_norm and the router's norm), in float32."""
    wide = hidden.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(hidden.dtype)


def layer_view(pool: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """One layer's pool [num_slots, 1, row width] seen as [num_slots, num_kv_heads, head_dim] (its first columns)."""
    num_slots = pool.shape[0]
    return pool.view(num_slots, -1)[:, : num_kv_heads * head_dim].view(num_slots, num_kv_heads, head_dim)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer_index: int, rotary: RotaryEmbedding, group: ParallelGroup) -> None:
        super().__init__()
        spec = config.layers[layer_index]
        self.layer_index = layer_index
        self.kv_source = spec.kv_source
        self.shares_kv = spec.kv_source != layer_index
        self.num_heads = group.split(config.num_heads, "num_attention_heads")
        kv_field = "num_key_value_heads" if spec.sliding else "the full layers' num_key_value_heads"
        self.num_kv_heads = group.split(spec.num_kv_heads, kv_field)
        self.head_dim = spec.head_dim
        self.sliding_window = config.sliding_window if spec.sliding else None
        self.has_values = not self.shares_kv and not spec.values_from_keys
        self.eps = config.rms_norm_eps
        q_size, kv_size = config.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        parts = {"q": q_size}
        if not self.shares_kv:
            parts["k"] = kv_size
        if self.has_values:
            parts["v"] = kv_size
        self.qkv_proj = PackedLinear(config.hidden_size, parts, config.attention_bias, group)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.attention_bias, group)
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, float32_scale=True)
        self.k_norm = None if self.shares_kv else RMSNorm(spec.head_dim, config.rms_norm_eps, float32_scale=True)
        self.rotary = rotary

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] the normed residual stream
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        produced: ProducedKV,
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        packed = self.qkv_proj(hidden)  # [num_tokens, q_size (+ kv_size for k) (+ kv_size for v)]
        query = self.q_norm(packed[:, :q_size].view(num_tokens, self.num_heads, self.head_dim))
        query = self.rotary.rotate(metadata.positions, query)
        if self.shares_kv:
            key, value = produced[self.kv_source]
        else:
            assert self.k_norm is not None
            raw_key = packed[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            raw_value = packed[:, q_size + kv_size :].view(raw_key.shape) if self.has_values else raw_key
            key = self.rotary.rotate(metadata.positions, self.k_norm(raw_key))
            value = rms_normalize(raw_value, self.eps)
            produced[self.layer_index] = (key, value)
        attended = metadata.attention.attend(
            query,
            key,
            value,
            layer_view(cache.keys[self.kv_source], self.num_kv_heads, self.head_dim),
            layer_view(cache.values[self.kv_source], self.num_kv_heads, self.head_dim),
            1.0,
            self.sliding_window,
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(attended.reshape(num_tokens, q_size))


class Gemma4Router(nn.Module):
    """The checkpoint's `router`: proj [E, H], scale [H], per_expert_scale [E]."""

    def __init__(self, hidden_size: int, moe: Gemma4MoEConfig, eps: float) -> None:
        super().__init__()
        self.proj = Linear(hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.experts_per_token = moe.experts_per_token
        self.eps = eps
        self.input_scale = hidden_size**-0.5

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] the residual stream entering the MLP
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> experts [num_tokens, k] ids, weights [num_tokens, k] float32
        scaled = rms_normalize(hidden, self.eps) * self.scale * self.input_scale
        probabilities = F.softmax(self.proj(scaled), dim=-1, dtype=torch.float32)  # [num_tokens, E]
        weights, experts = probabilities.topk(self.experts_per_token, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.per_expert_scale[experts]


class Gemma4Experts(nn.Module):
    """The checkpoint's `experts`: gate_up_proj [E, 2 * I, H] (gate rows first) and down_proj [E, H, I]; this rank's
    experts only (module docstring)."""

    def __init__(self, hidden_size: int, moe: Gemma4MoEConfig, activation: str, group: ParallelGroup) -> None:
        super().__init__()
        self.num_local = group.split(moe.num_experts, "num_experts")
        self.first = group.rank * self.num_local  # global id of this rank's first expert
        self.num_experts = moe.num_experts
        size = moe.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden_size, size))
        self.activation = ACTIVATIONS[activation]
        self.group = group

    def shard_spec(self, parameter_name: str, part: str | None) -> ShardSpec:
        local: torch.Tensor = getattr(self, parameter_name)
        return ShardSpec((self.num_experts, *local.shape[1:]), dim=0, start=self.first, size=self.num_local)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] the experts' input (normed)
        experts: torch.Tensor,  # [num_tokens, k] chosen expert ids
        weights: torch.Tensor,  # [num_tokens, k] float32
    ) -> torch.Tensor:  # -> [num_tokens, hidden], summed over ranks
        output = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            local = expert - self.first
            if not 0 <= local < self.num_local:
                continue
            tokens, slots = (experts == expert).nonzero(as_tuple=True)
            gate, up = F.linear(hidden[tokens], self.gate_up_proj[local]).chunk(2, dim=-1)
            expert_output = F.linear(self.activation(gate) * up, self.down_proj[local])
            output.index_add_(0, tokens, (expert_output * weights[tokens, slots, None]).to(hidden.dtype))
        return all_reduce(output, self.group)
