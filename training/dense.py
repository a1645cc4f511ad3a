"""Dense, batched forward passes over the serving modules, for training and batched generation.

The served models run on the paged KV cache one packed sequence at a time. Training wants [batch, time] tensors and
causal (or hand-built) masks instead, so this module drives the very same submodules (projections, norms, rotary,
MLP) with dense scaled-dot-product attention: whatever is trained here is what the servers load.

Attention kinds are looked up by module type in `DENSE_ATTENTION`: grouped-query attention (Llama family, EAGLE3
Llama heads, chained MTP layers) and multi-head latent attention (EAGLE3 MLA heads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.mla import MultiHeadLatentAttention
from tandem.layers.norm import RMSNorm
from tandem.models.eagle3 import Eagle3Draft
from tandem.models.llama import LlamaForCausalLM
from tandem.models.mtp import MTPLayer, MTPLayerOutput, MTPModel


@dataclass
class DenseKV:
    """Keys and values of every layer for a batch of equally long sequences, grown token by token."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [batch, kv_heads, length, key_dim]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer [batch, kv_heads, length, value_dim]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0


@dataclass(frozen=True)
class DenseTargetOutput:
    normed: torch.Tensor  # [batch, time, hidden] final-norm output, the LM-head input
    captured: dict[int, torch.Tensor]  # capture index -> [batch, time, hidden] residual stream entering that layer


def project_qkv(
    attention: Attention,
    hidden: torch.Tensor,  # [batch, time, input_size]
    positions: torch.Tensor,  # [time], shared by every sequence of the batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # each [batch, heads, time, head_dim]
    """Query, key and value of the rows, rotated by their positions, in the layout SDPA takes."""
    batch, time = hidden.shape[:2]
    head_dim = attention.head_dim
    sizes = [attention.num_heads * head_dim, attention.num_kv_heads * head_dim, attention.num_kv_heads * head_dim]
    query, key, value = attention.qkv_proj(hidden).split(sizes, dim=-1)
    query = query.reshape(batch * time, attention.num_heads, head_dim)
    key = key.reshape(batch * time, attention.num_kv_heads, head_dim)
    value = value.reshape(batch, time, attention.num_kv_heads, head_dim)
    if attention.q_norm is not None and attention.k_norm is not None:
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = attention.rotary(positions.repeat(batch), query, key)
    query = query.view(batch, time, attention.num_heads, head_dim)
    key = key.view(batch, time, attention.num_kv_heads, head_dim)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def attend(
    attention: Attention,
    query: torch.Tensor,  # [batch, heads, time, head_dim]
    keys: torch.Tensor,  # [batch, kv_heads, context, head_dim]
    values: torch.Tensor,  # [batch, kv_heads, context, head_dim]
    mask: torch.Tensor | None,  # [time, context] bool, True = visible; None: causal, or all for one row
) -> torch.Tensor:  # -> [batch, time, output_size]
    if attention.sliding_window is not None:
        raise ValueError("dense attention: sliding-window layers are not supported for training")
    return _attend_rows(attention.o_proj, query, keys, values, mask, attention.scaling)


def project_latent_qkv(
    attention: MultiHeadLatentAttention,
    hidden: torch.Tensor,  # [batch, time, input_size]
    positions: torch.Tensor,  # [time], shared by every sequence of the batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [batch, heads, time, qk_dim] twice, [batch, heads, time, v]
    """MLA's query, key and value with the latent up-projected per head (kv_b_proj), the training form.

    Serving attends over the latent with kv_b_proj absorbed into query and output (tandem.layers.mla); both give
    the same scores and outputs, and for a full causal pass this form costs less. The projections, norms and rotary
    are the serving module's own.
    """
    config = attention.config
    batch, time = hidden.shape[:2]
    heads, nope, rope = config.num_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    query, kv = attention._project(hidden)  # the serving down/up projections, fused or not
    query = query.reshape(batch * time, heads, nope + rope)
    query_nope, query_rope = query.split([nope, rope], dim=-1)
    latent, key_rope = kv.reshape(batch * time, -1).split([config.kv_lora_rank, rope], dim=-1)
    # key_rope is one head shared by all query heads: [batch * time, 1, rope].
    query_rope, key_rope = attention.rotary(positions.repeat(batch), query_rope, key_rope[:, None, :])
    # kv_b_proj's rows are, head by head, qk_nope_head_dim key rows then v_head_dim value rows.
    up = attention.kv_b_proj(attention.kv_a_layernorm(latent)).view(batch * time, heads, nope + config.v_head_dim)
    key_nope, value = up.split([nope, config.v_head_dim], dim=-1)
    query = torch.cat([query_nope, query_rope], dim=-1)
    key = torch.cat([key_nope, key_rope.expand(-1, heads, -1)], dim=-1)
    return (
        query.view(batch, time, heads, -1).transpose(1, 2),
        key.view(batch, time, heads, -1).transpose(1, 2),
        value.reshape(batch, time, heads, -1).transpose(1, 2),
    )


def attend_latent(
    attention: MultiHeadLatentAttention,
    query: torch.Tensor,  # [batch, heads, time, qk_dim]
    keys: torch.Tensor,  # [batch, heads, context, qk_dim]
    values: torch.Tensor,  # [batch, heads, context, v_head_dim]
    mask: torch.Tensor | None,  # [time, context] bool, True = visible; None: causal, or all for one row
) -> torch.Tensor:  # -> [batch, time, hidden]
    return _attend_rows(attention.o_proj, query, keys, values, mask, attention.config.softmax_scale)


def _attend_rows(
    o_proj: nn.Module,
    query: torch.Tensor,  # [batch, heads, time, qk_dim]
    keys: torch.Tensor,  # [batch, kv_heads, context, qk_dim]; kv_heads divides heads
    values: torch.Tensor,  # [batch, kv_heads, context, v_dim]
    mask: torch.Tensor | None,  # [time, context] bool, True = visible; None: causal, or all for one row
    scale: float | None,
) -> torch.Tensor:  # -> [batch, time, output_size]
    is_causal = mask is None and query.shape[2] > 1
    attended = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
    )
    batch, _, time, _ = attended.shape
    return o_proj(attended.transpose(1, 2).reshape(batch, time, -1))


@dataclass(frozen=True)
class DenseAttention:
    """How one attention module type runs densely: rows -> (query, key, value), then attention -> output rows."""

    project: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attend: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


DENSE_ATTENTION: dict[type[nn.Module], DenseAttention] = {
    Attention: DenseAttention(project_qkv, attend),
    MultiHeadLatentAttention: DenseAttention(project_latent_qkv, attend_latent),
}


class DenseLayer(Protocol):
    """A pre-norm decoder layer as the dense paths drive it (LlamaDecoderLayer, DeepSeek-V3's MLA layer)."""

    @property
    def input_layernorm(self) -> RMSNorm: ...
    @property
    def self_attn(self) -> nn.Module: ...
    @property
    def post_attention_layernorm(self) -> RMSNorm: ...
    @property
    def mlp(self) -> nn.Module: ...


def dense_attention(layer: DenseLayer) -> DenseAttention:
    kind = DENSE_ATTENTION.get(type(layer.self_attn))
    if kind is None:
        known = ", ".join(t.__name__ for t in DENSE_ATTENTION)
        raise ValueError(f"dense training: {type(layer.self_attn).__name__} layers are not supported ({known})")
    return kind


def decoder_layer(
    layer: DenseLayer,
    hidden: torch.Tensor,  # [batch, time, hidden] residual stream entering the layer
    positions: torch.Tensor,  # [time]
    cache: DenseKV | None,
    layer_index: int,
) -> torch.Tensor:  # -> [batch, time, hidden] residual stream leaving the layer
    """The layer's forward with dense attention; with a cache the rows continue the cached sequences."""
    kind = dense_attention(layer)
    query, key, value = kind.project(layer.self_attn, layer.input_layernorm(hidden), positions)
    mask = None
    if cache is not None:
        if layer_index < len(cache.keys):
            key = torch.cat([cache.keys[layer_index], key], dim=2)
            value = torch.cat([cache.values[layer_index], value], dim=2)
            cache.keys[layer_index], cache.values[layer_index] = key, value
        else:
            cache.keys.append(key)
            cache.values.append(value)
        time, context = query.shape[2], key.shape[2]
        if time > 1 and context > time:
            # Bottom-right aligned causal mask: the new rows sit at the end of the context. A single new row
            # needs no mask (it sees everything), and with context == time the plain causal mask applies.
            offset = context - time
            mask = torch.arange(context)[None, :] <= torch.arange(time)[:, None] + offset
    hidden = hidden + kind.attend(layer.self_attn, query, key, value, mask)
    mlp_output: torch.Tensor = layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden + mlp_output


def target_forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,  # [batch, time]
    capture: Sequence[int] = (),  # capture indices as in LlamaForCausalLM.forward
    cache: DenseKV | None = None,  # continue these sequences; None = the rows start at position 0
) -> DenseTargetOutput:
    start = cache.length if cache is not None else 0
    positions = torch.arange(start, start + input_ids.shape[1])
    wanted = set(capture)
    captured: dict[int, torch.Tensor] = {}
    hidden = model.model.embed_tokens(input_ids)
    for index, layer in enumerate(model.model.layers):
        if index in wanted:
            captured[index] = hidden
        hidden = decoder_layer(layer, hidden, positions, cache, index)  # type: ignore[arg-type]
    if model.config.num_layers in wanted:
        captured[model.config.num_layers] = hidden
    normed = model.model.norm(hidden)
    if model.config.num_layers + 1 in wanted:  # the final norm's output
        captured[model.config.num_layers + 1] = normed
    return DenseTargetOutput(normed=normed, captured=captured)


def chain_mask(time: int, step: int) -> torch.Tensor:  # -> [time, (step + 1) * time] bool, True = visible
    """What the draft row of anchor p at chain step `step` (0 = the ingested row) may attend to.

    At inference (draft_server/runner.py) the committed rows 0..p come from ingest, and each later step of the
    chain that ended at p adds one speculative KV row at position p + step. So block 0 (ingested rows) is causal,
    and block i >= 1 (the rows of step i) is visible only on the diagonal, the same anchor's own row.
    Example, time 3, step 1: [[1 0 0 | 1 0 0], [1 1 0 | 0 1 0], [1 1 1 | 0 0 1]].
    """
    causal = torch.ones(time, time, dtype=torch.bool).tril()
    diagonal = torch.eye(time, dtype=torch.bool)
    return torch.cat([causal, *([diagonal] * step)], dim=1)


def unrolled_draft_logits(
    draft: Eagle3Draft,
    features: torch.Tensor,  # [batch, time, num_aux * target_hidden] target aux features of positions 0..time-1
    step_tokens: Sequence[torch.Tensor],  # per chain step, [batch, time]: the token the row of anchor p takes
) -> list[torch.Tensor]:  # per chain step, [batch, time, draft_vocab] float32 logits
    """The draft chain unrolled for every anchor at once (EAGLE-3's training-time test).

    Step 0 is the ingest of committed rows: the row of anchor p takes (target feature of p, token x[p+1]).
    Step j >= 1 is the row at position p + j: it takes the hidden of the previous step of the same anchor and
    the token step_tokens[j][:, p], and attends as chain_mask describes, exactly as the inference chain does.
    Any head whose layer kind has a dense attention (DENSE_ATTENTION) trains this way: Llama layers and MLA layers.
    """
    layer: DenseLayer = draft.layer  # type: ignore[assignment]  # both EAGLE3 layer kinds are DenseLayers
    kind = dense_attention(layer)
    time = features.shape[1]
    hidden = draft.project_features(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits = []
    for step, tokens in enumerate(step_tokens):
        positions = torch.arange(step, step + time)
        embedded = layer.input_layernorm(draft.embedded(tokens))
        attention_input = torch.cat([embedded, draft.hidden_norm(hidden)], dim=-1)  # [batch, time, 2 * hidden]
        query, key, value = kind.project(layer.self_attn, attention_input, positions)
        keys.append(key)
        values.append(value)
        mask = chain_mask(time, step).to(query.device)
        stream = hidden + kind.attend(layer.self_attn, query, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
        normed = draft.norm(stream)
        logits.append(draft.lm_head(normed).float())
        hidden = normed if draft.config.norm_output else stream
    return logits


def unrolled_mtp_outputs(
    model: MTPModel,
    target_hidden: torch.Tensor,  # [batch, time, hidden] the target's pre-norm final stream h_T at positions 0..time-1
    step_tokens: Sequence[torch.Tensor],  # per MTP layer k, [batch, time]: the token row p takes, x[p + k + 1]
    chain: bool = True,
) -> list[MTPLayerOutput]:  # per MTP layer, stream and normed [batch, time, hidden]
    """Every chained MTP layer over every position at once, each layer one causal pass (training.mtp says why
    that is the runner's chain): layer k's row p takes (h_{k-1}[p], step_tokens[k][:, p]), h_{-1} = target_hidden;
    without `chain` every layer takes target_hidden, as the runner's non-chain mode does."""
    positions = torch.arange(target_hidden.shape[1], device=target_hidden.device)
    hidden = target_hidden
    outputs = []
    for index, tokens in enumerate(step_tokens):
        layer = cast(MTPLayer, model.layers[index])
        source = hidden if chain else target_hidden
        fused = layer.eh_proj(torch.cat([layer.enorm(model.embed_tokens(tokens)), layer.hnorm(source)], dim=-1))
        stream = decoder_layer(cast(DenseLayer, layer.decoder), fused, positions, None, 0)
        outputs.append(MTPLayerOutput(stream=stream, normed=layer.shared_head.norm(stream)))
        hidden = stream
    return outputs
