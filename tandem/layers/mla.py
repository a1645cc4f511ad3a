"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-K2) over a compressed paged KV cache.

Per token the cache keeps one row: the normalized kv latent (kv_lora_rank) followed by the rope'd shared key part
(qk_rope_head_dim), nothing per head. Per head h, keys and values are up-projections of the latent by kv_b_proj:
    key_h   = [latent @ key_up_h^T, key_rope]        value_h = latent @ value_up_h^T
Attention is computed from the latent itself, with the up-projections absorbed into the query and the output:
    query_h . key_h = (query_nope_h @ key_up_h) . latent + query_rope_h . key_rope
    sum_j p_j value_hj = (sum_j p_j latent_j) @ value_up_h^T
so the cached row is both the key (all of it) and the value (its first kv_lora_rank columns) of a single shared KV
head, and nothing of size context is up-projected per step. Tensor parallel: each rank computes its share of the
heads (q_b_proj and kv_b_proj column parallel, o_proj row parallel) from the same latent, which every rank caches
whole; the down projections are replicated. This is the formulation DeepSeek uses for decoding; it
costs more FLOPs than up-projecting the keys and values for a long fresh prefill (the score dot products run over
kv_lora_rank + rope instead of nope + rope dims), but verification steps, a few queries over a long context, are
what this target runs most, and one path for both keeps prefill and decode numerically alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.linear import PackedLinear
from tandem.layers.matmul import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ColumnParallelLinear, RowParallelLinear

# The q and kv latent norms are built without the config's rms_norm_eps in DeepSeek's code and in transformers.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: one plain q_proj instead of the low-rank q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj (never on q_proj, q_b_proj, kv_b_proj)
    softmax_scale: float  # (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times the YaRN mscale correction

    @property
    def cache_layout(self) -> CacheLayout:
        return CacheLayout(num_kv_heads=1, key_dim=self.kv_lora_rank + self.qk_rope_head_dim, value_dim=0)


class MultiHeadLatentAttention(nn.Module):
    """Module and parameter names are the checkpoint's (model.layers.N.self_attn.kv_b_proj ...).

    `input_size` is the width of the projections' input (2*hidden for an EAGLE3 head, which attends over
    concat([embedding, hidden])). With `fused_a_projection` the q and kv down projections are one matmul,
    `fused_qkv_a_proj_with_mqa`, whose rows are q_a_proj's then kv_a_proj_with_mqa's (loaded part by part); it needs
    the low-rank query (q_lora_rank set).
    """

    def __init__(
        self,
        layer_index: int,
        config: MLAConfig,
        rotary: RotaryEmbedding,
        input_size: int | None = None,  # None: config.hidden_size
        fused_a_projection: bool = False,
        group: ParallelGroup = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.config = config
        self.rotary = rotary
        self.heads = group.split(config.num_heads, "num_attention_heads")  # this rank's
        input_size = input_size or config.hidden_size
        query_size = config.num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim)
        kv_a_size = config.kv_lora_rank + config.qk_rope_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        self.kv_a_proj_with_mqa: nn.Linear | None = None
        self.fused_qkv_a_proj_with_mqa: PackedLinear | None = None
        if config.q_lora_rank is None:
            if fused_a_projection:
                raise ValueError("a fused q/kv down projection needs q_lora_rank")
            self.q_proj = ColumnParallelLinear(input_size, query_size, False, group, "num_attention_heads")
        else:
            if fused_a_projection:
                parts = {"q_a": config.q_lora_rank, "kv_a": kv_a_size}
                self.fused_qkv_a_proj_with_mqa = PackedLinear(input_size, parts, bias=config.attention_bias)
            else:
                self.q_a_proj = Linear(input_size, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, query_size, False, group, "num_attention_heads")
        if not fused_a_projection:
            self.kv_a_proj_with_mqa = Linear(input_size, kv_a_size, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        up_size = config.num_heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, up_size, False, group, "num_attention_heads")
        value_size = config.num_heads * config.v_head_dim
        self.o_proj = RowParallelLinear(value_size, config.hidden_size, config.attention_bias, group)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, input_size]
        metadata: AttentionMetadata,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # -> [num_tokens, hidden]
        config = self.config
        num_tokens = hidden.shape[0]
        query, kv = self._project(hidden)
        query = query.view(num_tokens, self.heads, -1)
        query_nope, query_rope = query.split([config.qk_nope_head_dim, config.qk_rope_head_dim], dim=-1)
        latent, key_rope = kv.split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [num_tokens, kv_lora_rank]
        # key_rope is one head shared by all query heads: [num_tokens, 1, qk_rope_head_dim].
        query_rope, key_rope = self.rotary(metadata.positions, query_rope, key_rope[:, None, :])
        # kv_b_proj's rows are, head by head, qk_nope_head_dim key rows then v_head_dim value rows.
        up_projection = self.kv_b_proj.float_weight().view(self.heads, -1, config.kv_lora_rank)
        key_up, value_up = up_projection.split([config.qk_nope_head_dim, config.v_head_dim], dim=1)
        query_latent = torch.einsum("thn,hnc->thc", query_nope, key_up)  # [num_tokens, heads, kv_lora_rank]
        rows = torch.cat((latent[:, None, :], key_rope), dim=-1)  # [num_tokens, 1, kv_lora_rank + rope]
        attended = metadata.attention.attend_latent(
            torch.cat((query_latent, query_rope), dim=-1),
            rows,
            cache.keys[self.layer_index],  # [slots, 1, kv_lora_rank + rope]: MLA keeps no values
            config.kv_lora_rank,
            config.softmax_scale,
        )  # [num_tokens, heads, kv_lora_rank]
        output = torch.einsum("thc,hvc->thv", attended, value_up)  # [num_tokens, heads, v_head_dim]
        return self.o_proj(output.reshape(num_tokens, self.heads * config.v_head_dim))

    def _project(
        self,
        hidden: torch.Tensor,  # [num_tokens, input_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> query [num_tokens, heads * qk_dim], kv [num_tokens, kv_lora + rope]
        """The query and the kv down projection (latent, then the shared rope key part), before any norm."""
        config = self.config
        if self.fused_qkv_a_proj_with_mqa is not None:
            assert config.q_lora_rank is not None
            query_latent, kv = self.fused_qkv_a_proj_with_mqa(hidden).split(
                [config.q_lora_rank, config.kv_lora_rank + config.qk_rope_head_dim], dim=-1
            )
        else:
            assert self.kv_a_proj_with_mqa is not None
            kv = self.kv_a_proj_with_mqa(hidden)
            if self.q_proj is not None:
                return self.q_proj(hidden), kv
            assert self.q_a_proj is not None
            query_latent = self.q_a_proj(hidden)
        assert self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(query_latent)), kv
