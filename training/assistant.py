"""Trains Gemma 4's assistant (tandem.models.gemma4_assistant) for a Gemma 4 target, on the target's own greedy
continuations, and saves it as transformers' save_pretrained lays it out (Gemma4AssistantForCausalLM).

Data (training.served_data): per position t the token x[t], the target's greedy token g[t] for t + 1, its final
normed hidden h[t] and the K/V rows of its kept layers (tandem.models.gemma4.Gemma4ForCausalLM.kept_kv).

Training-time test: the round the replica runs (draft_server/assistant_runner.py) is unrolled for every anchor t at
once. After the target has run x[0..t], the round sits at position t + 1 and reads the kept rows 0..t (a sliding
layer the last sliding_window + 1 of them):
    step 0  (x[t + 1], h[t])                        -> label g[t + 1]
    step j  (g[t + j], the previous step's hidden')  -> label g[t + j + 1]
Along the accepted path the drafted token of step j is g[t + j], so the labels are what greedy verification accepts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import Gemma4TextConfig
from transformers.models.gemma4_assistant import Gemma4AssistantConfig

from tandem.models.gemma4_assistant import (
    AssistantAttention,
    AssistantConfig,
    AssistantLayer,
    Gemma4Assistant,
    capture_indices,
)
from tandem.models.registry import TargetModel
from tandem.models.stack import KeptKV
from training.checkpoint import checkpoint_tensors, save_tensors
from training.eagle3 import IGNORED_LABEL, DraftData, shifted
from training.gemma4_target import FULL, SLIDING
from training.heads import DraftRecord, DraftTraining, draw_matrices, step_losses, train_head
from training.target import LossPoint

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [batch, time, kv heads, head_dim]


@dataclass(frozen=True)
class AssistantShape:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    layer_types: tuple[str, ...] = (SLIDING, FULL)  # each reads the target's kept layer of its type

    def hf_config(self, target_config: dict[str, Any], kept: tuple[KeptKV, ...]) -> dict[str, Any]:
        """config.json as transformers writes it; the heads' geometry, window and rotary are the target's."""
        by_type = {layer.sliding: layer for layer in kept}
        sliding, full = by_type[True], by_type[False]
        full_shapes: dict[str, Any] = {
            "num_global_key_value_heads": full.num_kv_heads,
            "global_head_dim": full.head_dim,
        }
        text = Gemma4TextConfig(
            vocab_size=target_config["vocab_size"],
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=len(self.layer_types),
            layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads,
            num_key_value_heads=sliding.num_kv_heads,
            head_dim=sliding.head_dim,
            attention_k_eq_v=target_config.get("attention_k_eq_v", False),
            sliding_window=target_config["sliding_window"],
            max_position_embeddings=target_config["max_position_embeddings"],
            rope_parameters=target_config["rope_parameters"],
            rms_norm_eps=target_config["rms_norm_eps"],
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=0,
            final_logit_softcapping=None,
            tie_word_embeddings=True,
            dtype="bfloat16",
            **full_shapes,
        )
        config = Gemma4AssistantConfig(
            text_config=text, backbone_hidden_size=target_config["hidden_size"], use_ordered_embeddings=False
        )
        config.architectures = ["Gemma4AssistantForCausalLM"]
        result: dict[str, Any] = config.to_dict()
        return result


def build_assistant(hf_config: dict[str, Any], target_embedding: torch.Tensor, seed: int) -> Gemma4Assistant:
    """A freshly initialised assistant; its view of the target's table (`target_embed`) is the target's, frozen."""
    model = Gemma4Assistant(AssistantConfig.from_hf(hf_config))
    draw_matrices(model, seed)
    model.target_embed.weight.data.copy_(target_embedding)
    model.target_embed.weight.requires_grad_(False)
    return model


def split_rows(
    features: torch.Tensor, model: Gemma4Assistant, kept: tuple[KeptKV, ...]
) -> tuple[torch.Tensor, dict[bool, KV]]:
    """Collected rows [batch, time, hidden + per kept layer keys and values] -> hidden, K/V by layer type."""
    batch, time, _ = features.shape
    hidden = features[..., : model.config.backbone_hidden_size]
    kv: dict[bool, KV] = {}
    start = hidden.shape[-1]
    for layer in kept:
        width = layer.num_kv_heads * layer.head_dim
        keys, values = features[..., start : start + width], features[..., start + width : start + 2 * width]
        shape = (batch, time, layer.num_kv_heads, layer.head_dim)
        kv[layer.sliding] = (keys.reshape(shape), values.reshape(shape))
        start += 2 * width
    return hidden, kv


def visible_rows(time: int, window: int | None) -> torch.Tensor:  # -> [time, time] bool: anchor t reads row j
    anchors, rows = torch.arange(time)[:, None], torch.arange(time)[None, :]
    seen = rows <= anchors
    return seen if window is None else seen & (rows >= anchors - window)


def dense_attention(
    attention: AssistantAttention,
    normed: torch.Tensor,  # [batch, time, hidden]
    positions: torch.Tensor,  # [batch * time]
    kv: KV,
    visible: torch.Tensor,  # [time, time]
) -> torch.Tensor:  # -> [batch, time, hidden]
    batch, time, _ = normed.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    query = attention.q_norm(attention.qkv_proj(normed).view(batch * time, heads, head_dim))
    query = attention.rotary.rotate(positions, query).view(batch, time, heads, head_dim).transpose(1, 2)
    keys, values = (part.transpose(1, 2).to(query.dtype) for part in kv)
    attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=1.0, enable_gqa=True)
    return attention.o_proj(attended.transpose(1, 2).flatten(2))


def dense_layer(
    layer: AssistantLayer, hidden: torch.Tensor, positions: torch.Tensor, kv: KV, visible: torch.Tensor
) -> torch.Tensor:
    """AssistantLayer.forward with every anchor's query in one batch."""
    attended = dense_attention(layer.self_attn, layer.input_layernorm(hidden), positions, kv, visible)
    hidden = hidden + layer.post_attention_layernorm(attended)
    hidden = hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    return hidden * layer.layer_scalar


def unrolled_assistant_logits(
    model: Gemma4Assistant,
    step_tokens: list[torch.Tensor],  # per step [batch, time] the token each anchor's step takes
    hidden: torch.Tensor,  # [batch, time, backbone] h[t]
    kv: dict[bool, KV],
) -> list[torch.Tensor]:  # per step [batch, time, vocab]
    """The module docstring's chain for every anchor; a step's hidden' feeds the next."""
    batch, time = step_tokens[0].shape
    positions = (torch.arange(time) + 1).repeat(batch)  # anchor t drafts at position t + 1
    window = model.config.text.sliding_window
    visible = {sliding: visible_rows(time, window if sliding else None) for sliding in (True, False)}
    table = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    logits = []
    for tokens in step_tokens:
        x = model.pre_projection(torch.cat([model.embed(tokens), hidden], dim=-1))
        for layer, sliding in zip(
            cast(list[AssistantLayer], list(model.model.layers)), model.config.sliding, strict=True
        ):
            x = dense_layer(layer, x, positions, kv[sliding], visible[sliding])
        x = model.model.norm(x)
        logits.append(F.linear(x, table))
        hidden = model.post_projection(x)
    return logits


def chain_tokens(
    data: DraftData, rows: torch.Tensor, num_steps: int, pad_id: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each step's tokens and labels (module docstring); rows past the sequence end are labelled IGNORED_LABEL."""
    tokens, argmax = data.tokens[rows], data.argmax[rows]
    step_tokens = [shifted(tokens, 1, pad_id), *(shifted(argmax, step, pad_id) for step in range(1, num_steps))]
    return step_tokens, [shifted(argmax, step + 1, IGNORED_LABEL) for step in range(num_steps)]


def train_assistant(
    model: Gemma4Assistant,
    data: DraftData,
    features: torch.Tensor,  # [num_sequences, length, hidden + kept K/V] the rows the assistant reads
    kept: tuple[KeptKV, ...],
    pad_id: int,
    settings: DraftTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
) -> DraftRecord:
    def batch_loss(rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        hidden, kv = split_rows(features[rows].float(), model, kept)
        step_tokens, step_labels = chain_tokens(data, rows, settings.num_steps, pad_id)
        logits = unrolled_assistant_logits(model, step_tokens, hidden, kv)
        return step_losses(logits, step_labels, settings.step_decay, IGNORED_LABEL)

    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return train_head(model, trained, data.tokens.shape[0], batch_loss, settings, "assistant", on_point)


def save_assistant(model: Gemma4Assistant, hf_config: dict[str, Any], directory: Path) -> None:
    """config.json and model.safetensors (bf16) as save_pretrained writes them, without the target's table."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = checkpoint_tensors(model)
    save_tensors({name: t for name, t in tensors.items() if not name.startswith("target_embed.")}, directory)


def assistant_capture(target: TargetModel) -> tuple[int, ...]:
    """The capture indices of the rows an assistant of this target reads (tandem.models.gemma4_assistant)."""
    return capture_indices(target.config.num_layers, (kept.layer for kept in target.kept_kv))
