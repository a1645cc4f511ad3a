"""Gemma 4 text causal LM (Gemma4ForCausalLM; the language model of Gemma4ForConditionalGeneration) on the paged KV
cache.

A layer, as transformers 5.24 computes it (every norm is plain weight * normed RMSNorm, multiplied in float32):

    hidden = hidden + post_attention_layernorm(self_attn(input_layernorm(hidden)))
    mlp_out = mlp(pre_feedforward_layernorm(hidden))
    with experts (enable_moe_block), from the same residual stream `hidden`:
        mlp_out = post_feedforward_layernorm_1(mlp_out)
                  + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(hidden), router(hidden)))
    hidden = hidden + post_feedforward_layernorm(mlp_out)
    with per-layer inputs:
        hidden = hidden + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(hidden)) * p_i))
    hidden = hidden * layer_scalar

Per-layer inputs p_i [hidden_size_per_layer_input] for layer i come from one table and one projection for all layers:
    p = (per_layer_projection_norm(per_layer_model_projection(e) / sqrt(hidden)) + embed_tokens_per_layer(id)
         * sqrt(per-layer size)) / sqrt(2), split into num_layers parts, where e is the scaled token embedding.
The embedding is scaled by sqrt(hidden) as in Gemma 3 (`model.embed_tokens` holds the raw table), the head is
usually tied, and the logits may be soft-capped. Attention and experts: tandem.models.gemma4_layers.

Tensor parallel: attention heads (both layer types' KV heads), dense MLP units and experts are split across ranks;
the embeddings, per-layer tables and the LM head stay replicated, as for Gemma 3. A shape tp does not divide is
refused naming it (e.g. "tp 4 does not divide the full layers' num_key_value_heads 2").
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.mlp import ACTIVATIONS, GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.gemma4_config import Gemma4Config, kv_row_layout
from tandem.models.gemma4_layers import Gemma4Attention, Gemma4Experts, Gemma4Router, ProducedKV
from tandem.models.stack import Backbone, CausalLM, Embeddings, KeptKV, TargetOutput, replaced, run_layers
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup, all_gather


def scaled(embedded: torch.Tensor, scale: float) -> torch.Tensor:
    """embedded * scale, the scale rounded to the embedding's dtype first, as transformers does."""
    return embedded * torch.tensor(scale, dtype=torch.float32, device=embedded.device).to(embedded.dtype)


class Gemma4DecoderLayer(nn.Module):
    layer_scalar: torch.Tensor  # [1], a buffer loaded from the checkpoint

    def __init__(self, config: Gemma4Config, layer_index: int, rotary: RotaryEmbedding, group: ParallelGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, float32_scale=True)
        self.self_attn = Gemma4Attention(config, layer_index, rotary, group)
        # Images' tokens see each other both ways on sliding layers only, and only where the config says "vision".
        self.images_both_ways = config.images_both_ways and config.layers[layer_index].sliding
        self.post_attention_layernorm = RMSNorm(hidden, eps, float32_scale=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, float32_scale=True)
        intermediate = config.layers[layer_index].intermediate_size
        self.mlp = GatedMLP(hidden, intermediate, config.hidden_activation, group)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, float32_scale=True)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.activation = ACTIVATIONS[config.hidden_activation]
        moe = config.moe
        self.router = None if moe is None else Gemma4Router(hidden, moe, eps)
        self.experts = None if moe is None else Gemma4Experts(hidden, moe, config.hidden_activation, group)
        self.post_feedforward_layernorm_1 = None if moe is None else RMSNorm(hidden, eps, float32_scale=True)
        self.post_feedforward_layernorm_2 = None if moe is None else RMSNorm(hidden, eps, float32_scale=True)
        self.pre_feedforward_layernorm_2 = None if moe is None else RMSNorm(hidden, eps, float32_scale=True)
        size = config.per_layer_input_size
        self.per_layer_input_gate = Linear(hidden, size, bias=False) if size else None
        self.per_layer_projection = Linear(size, hidden, bias=False) if size else None
        self.post_per_layer_input_norm = RMSNorm(hidden, eps, float32_scale=True) if size else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] residual stream entering the layer
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        per_layer_input: torch.Tensor | None,  # [num_tokens, hidden_size_per_layer_input]
        produced: ProducedKV,
    ) -> torch.Tensor:  # -> [num_tokens, hidden] residual stream leaving the layer
        if not self.images_both_ways:
            metadata = metadata.without_spans()
        attended = self.self_attn(self.input_layernorm(hidden), metadata, cache, produced)
        hidden = hidden + self.post_attention_layernorm(attended)
        hidden = hidden + self.post_feedforward_layernorm(self._feed_forward(hidden))
        if self.per_layer_input_gate is not None and per_layer_input is not None:
            assert self.per_layer_projection is not None and self.post_per_layer_input_norm is not None
            gated = self.activation(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar

    def _feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> [num_tokens, hidden]
        dense = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.router is None or self.experts is None:
            return dense
        assert self.pre_feedforward_layernorm_2 is not None
        assert self.post_feedforward_layernorm_1 is not None and self.post_feedforward_layernorm_2 is not None
        experts, weights = self.router(hidden)
        routed = self.experts(self.pre_feedforward_layernorm_2(hidden), experts, weights)
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)


class Gemma4Backbone(Backbone):
    def __init__(self, config: Gemma4Config, group: ParallelGroup) -> None:
        super().__init__()
        self.config = config
        dims = {spec.sliding: spec.head_dim for spec in config.layers}  # one head dim per type (gemma4_config)
        self.sliding_rotary = RotaryEmbedding(dims.get(True, config.head_dim), config.sliding_rope)
        self.full_rotary = RotaryEmbedding(dims[False], config.full_rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # unscaled, as in the checkpoint
        size, total = config.per_layer_input_size, config.per_layer_input_size * config.num_layers
        self.embed_tokens_per_layer = nn.Embedding(config.per_layer_vocab_size, total) if size else None
        self.per_layer_model_projection = Linear(config.hidden_size, total, bias=False) if size else None
        self.per_layer_projection_norm = RMSNorm(size, config.rms_norm_eps, float32_scale=True) if size else None
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, index, self.sliding_rotary if spec.sliding else self.full_rotary, group)
            for index, spec in enumerate(config.layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, float32_scale=True)

    def per_layer_inputs(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        embedded: torch.Tensor,  # [num_tokens, hidden] the scaled embedding
    ) -> torch.Tensor | None:  # -> [num_tokens, num_layers, hidden_size_per_layer_input]; None without them
        if self.embed_tokens_per_layer is None:
            return None
        assert self.per_layer_model_projection is not None and self.per_layer_projection_norm is not None
        config = self.config
        shape = (input_ids.shape[0], config.num_layers, config.per_layer_input_size)
        tokens = scaled(self.embed_tokens_per_layer(input_ids), config.per_layer_input_size**0.5).view(shape)
        projected = self.per_layer_model_projection(embedded) * config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        return (projected + tokens) * 2.0**-0.5


class Gemma4ForCausalLM(CausalLM[Gemma4Config]):
    model: Gemma4Backbone

    def __init__(self, config: Gemma4Config, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(
            config,
            group,
            Gemma4Backbone(config, group),
            Linear(config.hidden_size, config.vocab_size, bias=False),
            embedding_scale=config.hidden_size**0.5,
            logit_softcap=config.final_logit_softcapping,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        cache: PagedKVCache,  # laid out as cache_layout
        capture: Sequence[int] = (),  # capture indices in [0, num_layers + 1] (tandem.models.stack.run_layers)
        embeddings: Embeddings | None = None,
    ) -> TargetOutput:
        # An image's tokens are looked up as the pad token, then take the image's features as their embeddings; their
        # per-layer inputs are the pad token's row and the features' projection, as transformers' Gemma4Model has it.
        ids = input_ids if embeddings is None else input_ids.index_fill(0, embeddings[0], self.config.pad_token_id)
        embedded = scaled(self.model.embed_tokens(ids), self.config.hidden_size**0.5)  # [num_tokens, hidden]
        embedded = replaced(embedded, embeddings)
        per_layer = self.model.per_layer_inputs(ids, embedded)
        produced: ProducedKV = {}  # filled by the K/V-keeping layers, read by the KV-shared ones
        calls = [
            partial(layer, per_layer_input=None if per_layer is None else per_layer[:, index], produced=produced)
            for index, layer in enumerate(self.model.layers)
        ]
        output = run_layers(embedded, calls, self.model.norm, metadata, cache, capture)
        for index in capture:
            if index >= self.config.num_layers + 2:  # a kept layer's keys and values (kept_kv)
                key, value = produced[index - self.config.num_layers - 2]  # this rank's heads
                key, value = all_gather(key, self.group, dim=1), all_gather(value, self.group, dim=1)
                output.captured[index] = torch.cat([key.flatten(1), value.flatten(1)], dim=-1)
        return output

    @property
    def kept_kv(self) -> tuple[KeptKV, ...]:
        """The last layer of each type that keeps its own keys and values: what Gemma 4's assistant reads. Capture
        index num_layers + 2 + layer gives its rows, [num_tokens, 2 * num_kv_heads * head_dim] (keys, then values),
        as the cache keeps them: keys normed and rotated, values normed; under tensor parallel every rank's heads,
        gathered in rank order (every rank captures the same indices, so every rank takes part)."""
        last = {spec.sliding: index for index, spec in enumerate(self.config.layers) if spec.kv_source == index}
        return tuple(
            KeptKV(index, sliding, self.config.layers[index].num_kv_heads, self.config.layers[index].head_dim)
            for sliding, index in sorted(last.items(), key=lambda item: item[1])
        )

    @property
    def cache_layout(self) -> CacheLayout:
        """This rank's KV-cache row: as wide as its widest layer's share of K (or V) heads."""
        return kv_row_layout(self.config.layers, self.group.world_size)
