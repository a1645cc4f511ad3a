"""Trains an EAGLE3 head for a target, on the target's own greedy continuations, and saves it in a checkpoint layout.

Data: held-in prompts continued greedily by the target; for every position t of a sequence x we keep the target's
aux features f[t] and its greedy prediction g[t] (the token the target would put at t + 1).

Training-time test (EAGLE-3): the chain the draft server runs (draft_server/runner.py) is unrolled for every anchor
p at once (training.dense.unrolled_draft_logits):
    step 0  row of anchor p: (f[p], x[p + 1]), attends causally to ingested rows   -> label g[p + 1]
    step j  row at position p + j: (draft hidden of step j - 1, g[p + j])            -> label g[p + j + 1]
At inference the token of step j is the draft's own guess d_j; along the accepted path it equals g[p + j], so the
labels are exactly what greedy verification accepts. Labels outside the draft vocabulary are ignored.

Both EAGLE3 layer kinds train this way, through the same unrolled chain: Llama-layer heads (LlamaForCausalLMEagle3,
SpecForge's `midlayer.*` layout) and MLA heads (Eagle3DeepseekV2ForCausalLM, Kimi-K2.5's `layers.0.*` layout with
DeepSeek-V3 config keys), picked by `DraftShape.latent_attention`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tandem.models.aux_layers import resolve_capture
from tandem.models.eagle3 import Eagle3Config, Eagle3Draft
from tandem.models.llama import LlamaForCausalLM
from training.checkpoint import checkpoint_tensors, save_tensors
from training.dense import unrolled_draft_logits
from training.heads import DraftRecord, DraftTraining, draw_matrices, step_losses, train_head
from training.target import LossPoint, greedy_generate

IGNORED_LABEL = -100
# Checkpoint prefixes per head architecture, the inverse of tandem.models.eagle3.EAGLE3_RENAMES: SpecForge's
# `midlayer.*` for Llama-layer heads, `layers.0.*` for the MLA head as Kimi-K2.5 ships it.
EAGLE3_EXPORT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "LlamaForCausalLMEagle3": (("hidden_norm.", "midlayer.hidden_norm."), ("layer.", "midlayer.")),
    "Eagle3DeepseekV2ForCausalLM": (("hidden_norm.", "layers.0.hidden_norm."), ("layer.", "layers.0.")),
}


@dataclass(frozen=True)
class LatentAttentionShape:
    """MLA dimensions of an EAGLE3 MLA head (DeepSeek-V3 config keys); the heads are DraftShape.num_heads."""

    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 4
    draft_vocab_size: int = 2048
    # Output-of-layer convention (first id 1): capture indices are these + 1. For a 6-layer target, ids (1, 3, 5)
    # capture the streams entering layers 2 and 4 and the final pre-norm stream.
    aux_layer_ids: tuple[int, ...] = (1, 3, 5)
    # None: a Llama-layer head (num_kv_heads KV heads); set: an MLA head with these dimensions.
    latent_attention: LatentAttentionShape | None = None

    def hf_config(self, target_config: dict[str, Any]) -> dict[str, Any]:
        config = self._llama_config(target_config) if self.latent_attention is None else self._mla_config(target_config)
        config |= {
            "vocab_size": target_config["vocab_size"],
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
            "bos_token_id": target_config.get("bos_token_id"),
            "eos_token_id": target_config.get("eos_token_id"),
            "pad_token_id": target_config.get("pad_token_id"),
            "torch_dtype": "bfloat16",
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
                "norm_before_fc": False,
            },
        }
        if self.hidden_size != target_config["hidden_size"]:
            config["target_hidden_size"] = target_config["hidden_size"]
        return config

    def _llama_config(self, target_config: dict[str, Any]) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "hidden_act": "silu",
            "rms_norm_eps": target_config["rms_norm_eps"],
            "rope_theta": rope_theta(target_config),
            "rope_scaling": None,
            "max_position_embeddings": target_config["max_position_embeddings"],
        }

    def _mla_config(self, target_config: dict[str, Any]) -> dict[str, Any]:
        """DeepSeek-V3 keys as the Kimi-K2.5 head has them; plain rope (the demo's contexts are short)."""
        latent = self.latent_attention
        assert latent is not None
        return {
            "architectures": ["Eagle3DeepseekV2ForCausalLM"],
            "model_type": "kimi_k2",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads,
            "q_lora_rank": latent.q_lora_rank,
            "kv_lora_rank": latent.kv_lora_rank,
            "qk_nope_head_dim": latent.qk_nope_head_dim,
            "qk_rope_head_dim": latent.qk_rope_head_dim,
            "v_head_dim": latent.v_head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": target_config["rms_norm_eps"],
            "rope_theta": rope_theta(target_config),
            "rope_scaling": None,
            "rope_interleave": True,
            "attention_bias": False,
            "max_position_embeddings": target_config["max_position_embeddings"],
        }


@dataclass(frozen=True)
class DraftData:
    tokens: torch.Tensor  # [num_sequences, length] x
    argmax: torch.Tensor  # [num_sequences, length] g: g[:, t] is the target's greedy token for position t + 1
    features: torch.Tensor  # [num_sequences, length, num_aux * target_hidden] bf16


def collect_draft_data(
    target: LlamaForCausalLM,
    prompts: torch.Tensor,  # [num_sequences, prompt_length]
    num_new: int,
    capture: tuple[int, ...],
    batch_size: int,
    bf16_autocast: bool,
) -> DraftData:
    """Greedy continuations of the prompts by the target, with its aux features and greedy predictions."""
    tokens, argmaxes, features = [], [], []
    for first in tqdm(range(0, prompts.shape[0], batch_size), desc="continuations", unit="batch"):
        batch_tokens, batch_argmax, batch_features = greedy_generate(
            target, prompts[first : first + batch_size], num_new, capture, bf16_autocast
        )
        assert batch_features is not None
        tokens.append(batch_tokens)
        argmaxes.append(batch_argmax)
        features.append(batch_features)
    return DraftData(torch.cat(tokens), torch.cat(argmaxes), torch.cat(features))


def capture_indices(shape: DraftShape, num_target_layers: int) -> tuple[int, ...]:
    """The target capture indices for the head's layer ids, resolved the way the draft server resolves them."""
    return resolve_capture(shape.aux_layer_ids, num_target_layers, len(shape.aux_layer_ids)).indices


def captured_features(
    features: torch.Tensor,  # [..., len(capture) * target_hidden] the collected features, in capture order
    capture: Sequence[int],  # the indices the features were collected at
    wanted: Sequence[int],  # the indices a head takes, in its order
) -> torch.Tensor:  # -> [..., len(wanted) * target_hidden]; a view when wanted is a run of capture
    """The columns of one head's features, from data collected once for several heads."""
    width = features.shape[-1] // len(capture)
    first = capture.index(wanted[0])
    if tuple(capture[first : first + len(wanted)]) == tuple(wanted):
        return features.narrow(-1, first * width, len(wanted) * width)
    return torch.cat([features.narrow(-1, capture.index(index) * width, width) for index in wanted], dim=-1)


def draft_vocabulary(token_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:  # [vocab] -> [draft_vocab]
    """The draft_vocab_size most frequent target ids, in ascending id order; the draft id is the position."""
    most_frequent = token_counts.argsort(descending=True, stable=True)[:draft_vocab_size]
    result: torch.Tensor = most_frequent.sort().values
    return result


def d2t_offsets(draft_to_target: torch.Tensor) -> torch.Tensor:  # [draft_vocab] -> [draft_vocab] int64
    """SpecForge's d2t: target_id = draft_id + d2t[draft_id]."""
    return draft_to_target - torch.arange(draft_to_target.numel())


def build_draft(hf_config: dict[str, Any], draft_to_target: torch.Tensor, seed: int) -> Eagle3Draft:
    """A freshly initialised head from its config.json dict, with d2t set."""
    model = Eagle3Draft(Eagle3Config.from_hf(hf_config))
    draw_matrices(model, seed)
    with torch.no_grad():
        model.d2t.copy_(d2t_offsets(draft_to_target))  # type: ignore[operator]
    return model


def target_to_draft_map(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:  # -> [vocab] int64
    """Draft id of every target id, IGNORED_LABEL where the target id is not in the draft vocabulary."""
    mapping = torch.full((vocab_size,), IGNORED_LABEL, dtype=torch.long)
    mapping[draft_to_target] = torch.arange(draft_to_target.numel())
    return mapping


def chain_inputs(
    tokens: torch.Tensor,  # [batch, length] x
    argmax: torch.Tensor,  # [batch, length] g
    num_steps: int,
    target_to_draft: torch.Tensor,  # [vocab]
    pad_id: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per step: tokens [batch, length], draft labels [batch, length]
    """The tokens and labels of every chain step for every anchor p (see the module docstring).

    Rows whose token or label would lie past the sequence end take pad_id and IGNORED_LABEL.
    Example, length 4, step 1: tokens [g1, g2, g3, pad], labels [g2, g3, -, -] (labels as draft ids).
    """
    length = tokens.shape[1]
    step_tokens, step_labels = [], []
    for step in range(num_steps):
        source = tokens if step == 0 else argmax
        shift = 1 if step == 0 else step  # step 0 takes x[p + 1], step j takes g[p + j]
        step_tokens.append(shifted(source, shift, pad_id))
        labels = shifted(argmax, step + 1, 0)
        labels = target_to_draft[labels]
        labels[:, max(length - step - 1, 0) :] = IGNORED_LABEL
        step_labels.append(labels)
    return step_tokens, step_labels


def shifted(values: torch.Tensor, shift: int, fill: int) -> torch.Tensor:  # [batch, length] -> values[:, p + shift]
    result = torch.full_like(values, fill)
    if shift < values.shape[1]:
        result[:, : values.shape[1] - shift] = values[:, shift:]
    return result


def chain_loss(
    draft: Eagle3Draft,
    features: torch.Tensor,  # [batch, length, num_aux * target_hidden]
    step_tokens: list[torch.Tensor],  # per step [batch, length]
    step_labels: list[torch.Tensor],  # per step [batch, length] draft ids or IGNORED_LABEL
    step_decay: float,
) -> tuple[torch.Tensor, list[float]]:  # weighted loss, per-step accuracy over the labelled rows
    logits = unrolled_draft_logits(draft, features, step_tokens)
    return step_losses(logits, step_labels, step_decay, IGNORED_LABEL)


def train_draft(
    draft: Eagle3Draft,
    data: DraftData,
    target_to_draft: torch.Tensor,  # [vocab]
    pad_id: int,
    settings: DraftTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
    features: torch.Tensor | None = None,  # [num_sequences, length, num_aux * target_hidden]; None: data.features
    label: str = "eagle3",  # the progress bar's name
) -> DraftRecord:
    head_features = data.features if features is None else features

    def batch_loss(rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        step_tokens, step_labels = chain_inputs(
            data.tokens[rows], data.argmax[rows], settings.num_steps, target_to_draft, pad_id
        )
        return chain_loss(draft, head_features[rows].float(), step_tokens, step_labels, settings.step_decay)

    return train_head(draft, draft.parameters(), data.tokens.shape[0], batch_loss, settings, label, on_point)


def save_draft(draft: Eagle3Draft, hf_config: dict[str, Any], directory: Path) -> None:
    """config.json and model.safetensors (bf16) in the SpecForge layout, with d2t, t2d and the draft's embedding.

    The embedding is stored because the draft's hidden size differs from the target's, so the target's table
    cannot be shared.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    renames = EAGLE3_EXPORT_RENAMES[draft.config.architecture]
    tensors = checkpoint_tensors(draft, renames, packed=draft.config.layer_kind.name_map.packed)
    in_draft = torch.zeros(draft.config.layer.vocab_size, dtype=torch.bool)
    in_draft[draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))] = True
    tensors["t2d"] = in_draft
    save_tensors(tensors, directory)


def rope_theta(target_config: dict[str, Any]) -> float:
    parameters = target_config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", target_config.get("rope_theta", 10000.0)))
