"""Llama-family causal LM (Llama 3.x, Qwen2 with qkv bias, Qwen3 with q/k norm) on the paged KV cache.

Module names mirror the Hugging Face checkpoints (model.layers.N.self_attn...), so the only name
mapping the loader needs is the packing of q/k/v and gate/up (tandem.weights.names.PACKED_PARTS).

Tensor parallel (`group`): attention heads and MLP units are split across ranks (tandem.layers.attention, .mlp), the
embedding and LM head by the vocab-parallel rule (tandem.parallel.vocab); norms and the residual stream are
replicated, so every rank ends a layer with the same hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ModelConfig
from tandem.models.stack import TargetOutput, run_layers
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. `attention_input_size` is 2*hidden for EAGLE3 heads, which attend over
    concat([embedding, hidden]) instead of the normed residual stream."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        attention_input_size: int | None = None,
        group: ParallelGroup = SINGLE_PROCESS,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(
            layer_index=layer_index,
            input_size=attention_input_size or config.hidden_size,
            output_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qkv_bias=config.traits.qkv_bias,
            o_bias=config.traits.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.traits.qk_norm else None,
            group=group,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, group=group)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] residual stream entering the layer
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        attention_input: torch.Tensor | None = None,  # [num_tokens, attention_input_size]; default: normed hidden
    ) -> torch.Tensor:  # -> [num_tokens, hidden] residual stream leaving the layer
        if attention_input is None:
            attention_input = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(attention_input, metadata, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaBackbone(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, self.rotary, group=group) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.model = LlamaBackbone(config, group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        capture: Sequence[int] = (),  # capture indices in [0, num_layers + 1] (tandem.models.stack.run_layers)
    ) -> TargetOutput:
        hidden = self.model.embed_tokens(input_ids)
        return run_layers(hidden, self.model.layers, self.model.norm, metadata, cache, capture)

    @property
    def cache_layout(self) -> CacheLayout:
        """What one token leaves in one layer of this rank's KV cache: its share of the KV heads."""
        layout = self.config.cache_layout
        return CacheLayout(layout.num_kv_heads // self.group.world_size, layout.key_dim, layout.value_dim)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(normed).float()
