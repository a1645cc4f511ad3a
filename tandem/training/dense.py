"""Dense, batched forward passes over the serving modules, for training and batched generation.

The served models run on the paged KV cache one packed sequence at a time. Training wants [batch, time] tensors and
causal (or hand-built) masks instead, so this module drives the very same submodules (projections, norms, rotary,
MLP) with dense scaled-dot-product attention: whatever is trained here is what the servers load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.layers.attention import Attention
from tandem.models.eagle3 import Eagle3Draft
from tandem.models.llama import DecoderLayer, LlamaForCausalLM


@dataclass
class DenseKV:
    """Keys and values of every layer for a batch of equally long sequences, grown token by token."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [batch, kv_heads, length, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)

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
    is_causal = mask is None and query.shape[2] > 1
    attended = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=attention.scaling, enable_gqa=True
    )
    batch, _, time, _ = attended.shape
    return attention.o_proj(attended.transpose(1, 2).reshape(batch, time, -1))


def decoder_layer(
    layer: DecoderLayer,
    hidden: torch.Tensor,  # [batch, time, hidden] residual stream entering the layer
    positions: torch.Tensor,  # [time]
    cache: DenseKV | None,
    layer_index: int,
) -> torch.Tensor:  # -> [batch, time, hidden] residual stream leaving the layer
    """DecoderLayer.forward with dense attention; with a cache the rows continue the cached sequences."""
    query, key, value = project_qkv(layer.self_attn, layer.input_layernorm(hidden), positions)
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
    hidden = hidden + attend(layer.self_attn, query, key, value, mask)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


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
    return DenseTargetOutput(normed=model.model.norm(hidden), captured=captured)


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
    """
    layer = draft.layer
    time = features.shape[1]
    hidden = draft.project_features(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    logits = []
    for step, tokens in enumerate(step_tokens):
        positions = torch.arange(step, step + time)
        embedded = layer.input_layernorm(draft.embed_tokens(tokens))
        attention_input = torch.cat([embedded, draft.hidden_norm(hidden)], dim=-1)  # [batch, time, 2 * hidden]
        query, key, value = project_qkv(layer.self_attn, attention_input, positions)
        keys.append(key)
        values.append(value)
        mask = chain_mask(time, step).to(query.device)
        stream = hidden + attend(layer.self_attn, query, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
        normed = draft.norm(stream)
        logits.append(draft.lm_head(normed).float())
        hidden = normed if draft.config.norm_output else stream
    return logits
