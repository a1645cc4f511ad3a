"""Llama-family causal LM (Llama 3.x, Qwen2 with qkv bias, Qwen3 with q/k norm) on the paged KV cache.

Module names mirror the Hugging Face checkpoints (model.layers.N.self_attn...), so the only name
mapping the loader needs is the packing of q/k/v and gate/up (tandem.weights.names.PACKED_PARTS).

Tensor parallel (`group`): attention heads and MLP units are split across ranks (tandem.layers.attention, .mlp), the
embedding and LM head by the vocab-parallel rule (tandem.parallel.vocab); norms and the residual stream are
replicated, so every rank ends a layer with the same hidden states.
"""

from __future__ import annotations

from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ModelConfig
from tandem.models.stack import Backbone, CausalLM, DecoderLayer
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding


class LlamaDecoderLayer(DecoderLayer):
    """The shared pre-norm layer (tandem.models.stack.DecoderLayer) with grouped-query attention and a gated MLP.
    `attention_input_size` is 2*hidden for EAGLE3 heads, which attend over concat([embedding, hidden]) instead of
    the normed residual stream."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        attention_input_size: int | None = None,
        group: ParallelGroup = SINGLE_PROCESS,
    ) -> None:
        attention = Attention(
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
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, group=group)
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class LlamaBackbone(Backbone):
    def __init__(self, config: ModelConfig, group: ParallelGroup) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, index, self.rotary, group=group) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM[ModelConfig]):
    def __init__(self, config: ModelConfig, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(
            config, group, LlamaBackbone(config, group), ParallelLMHead(config.vocab_size, config.hidden_size, group)
        )
