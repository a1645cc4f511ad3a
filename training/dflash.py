"""Training a block drafter (tandem.models.dflash: DFlash, or DSpark) on the target's greedy continuations.

Each batch takes `anchors_per_batch` anchor positions a, the same for every sequence of the batch, in the generated
part of the sequences (a >= prompt_length - 1, so that every token after an anchor is the target's greedy choice).
Anchor a's block is [x_a, MASK x (B - 1)] at positions a .. a + B - 1; its context is the features of positions
0 .. a - 1; its i-th draft (0-based; DFlash: block row i + 1, DSpark: row i) is trained towards x_{a + 1 + i}, the
target's greedy token there, with weight step_decay ** i (the paper decays the loss with the position in the block
too). All the blocks of a batch run in one dense forward over the serving module's own submodules (training.dense):
every block row sees the context before its anchor and the rows of its own block, both ways, as a served block does.

DSpark adds, after the backbone, the Markov head (draft i's logits corrected from x_{a + i}, the token before it:
the target's, as the accepted drafts before it would be) and the confidence head, trained by binary cross-entropy
towards whether draft i's argmax is x_{a + 1 + i} (on the backbone's rows as they are, not moving them): the chance
that a draft is accepted given that the ones before it were.

The embedding and LM head are the target's, frozen; the checkpoint leaves them out (z-lab's layout; a DSpark
checkpoint without them takes the target's too).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.nn.functional import binary_cross_entropy_with_logits

from tandem.models.dflash import DFlashConfig, DFlashDraft, DFlashLayer
from tandem.models.registry import TargetModel
from training.checkpoint import checkpoint_tensors, save_tensors
from training.dense import attend, project_qkv
from training.eagle3 import DraftData, rope_theta
from training.heads import DraftRecord, DraftTraining, draw_matrices, step_losses, train_head
from training.target import LossPoint, OptimiserSettings

IGNORED_LABEL = -100


@dataclass(frozen=True)
class DFlashShape:
    num_layers: int = 2
    intermediate_size: int = 1024
    num_heads: int = 8
    num_kv_heads: int = 4
    block_size: int = 8  # 7 drafts a round
    target_layer_ids: tuple[int, ...] = (1, 3, 4)  # outputs of these target layers are the features

    def hf_config(self, target_config: dict[str, Any], mask_token_id: int) -> dict[str, Any]:
        """config.json in z-lab's layout; the width, vocabulary and rotary are the target's."""
        hidden = target_config["hidden_size"]
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": hidden,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": hidden // self.num_heads,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": target_config["rms_norm_eps"],
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta(target_config)},
            "max_position_embeddings": target_config["max_position_embeddings"],
            "vocab_size": target_config["vocab_size"],
            "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * self.num_layers,
            "use_sliding_window": False,
            "block_size": self.block_size,
            "num_target_layers": target_config["num_hidden_layers"],
            "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
            | gemma_fields(target_config),
            "torch_dtype": "bfloat16",
        }

    @property
    def drafts_per_round(self) -> int:
        return self.block_size - 1


@dataclass(frozen=True)
class DSparkShape(DFlashShape):
    block_size: int = 7  # 7 drafts a round: every row drafts
    markov_rank: int = 256

    def hf_config(self, target_config: dict[str, Any], mask_token_id: int) -> dict[str, Any]:
        """DeepSpec's layout: the block fields at the top level, with the Markov and confidence heads'."""
        config = super().hf_config(target_config, mask_token_id)
        return (
            config
            | config.pop("dflash_config")
            | {
                "architectures": ["Qwen3DSparkModel"],
                "markov_rank": self.markov_rank,
                "markov_head_type": "vanilla",
                "enable_confidence_head": True,
                "confidence_head_with_markov": True,
            }
        )

    @property
    def drafts_per_round(self) -> int:
        return self.block_size


def gemma_fields(target_config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma target applies inside its model that the drafter, reading its raw table and LM head, must apply
    too: the embedding's sqrt(hidden) and the logits' softcap (z-lab's `input_embedding_scale` and
    `final_logit_softcapping`)."""
    if not str(target_config.get("model_type", "")).startswith("gemma"):
        return {}
    cap = target_config.get("final_logit_softcapping")
    return {"input_embedding_scale": target_config["hidden_size"] ** 0.5} | (
        {"final_logit_softcapping": cap} if cap else {}
    )


def dflash_training_defaults() -> DraftTraining:
    return DraftTraining(
        epochs=16,  # the budget stops it first on 2 cores (6 epochs, about 5 minutes, left the loss falling)
        batch_size=16,
        num_steps=7,  # the block's drafts, for the accuracy record
        step_decay=0.8,
        optimiser=OptimiserSettings(learning_rate=2e-3, warmup_steps=50, weight_decay=0.0),
    )


def build_dflash(hf_config: dict[str, Any], target: TargetModel, seed: int) -> DFlashDraft:
    """A freshly initialised draft with the target's embedding and LM head, frozen."""
    model = DFlashDraft(DFlashConfig.from_hf(hf_config))
    draw_matrices(model, seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    model.embed_tokens.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    return model


def block_hidden(
    model: DFlashDraft,
    features: torch.Tensor,  # [batch, time, len(ids) * hidden]
    tokens: torch.Tensor,  # [batch, time]
    anchors: torch.Tensor,  # [anchors] positions, increasing
) -> torch.Tensor:  # -> [batch, anchors, drafts, hidden]
    """The final-norm outputs of every anchor's drafting rows, every sequence in one dense forward (module
    docstring)."""
    batch, time = tokens.shape
    size, mask_id = model.config.block_size, model.config.mask_token_id
    offsets = torch.arange(size)
    block_ids = torch.full((batch, len(anchors), size), mask_id)
    block_ids[:, :, 0] = tokens[:, anchors]
    block = model.embed_tokens(block_ids).flatten(1, 2) * model.config.embedding_scale  # [batch, anchors * B, hidden]
    positions = torch.cat([torch.arange(time), (anchors[:, None] + offsets).flatten()])
    own = torch.arange(len(anchors)).repeat_interleave(size)
    sees_context = torch.arange(time)[None, :] < anchors.repeat_interleave(size)[:, None]
    visible = torch.cat([sees_context, own[:, None] == own[None, :]], dim=1)  # [anchors * B, time + anchors * B]
    context = model.hidden_norm(model.fc(features))
    for layer in cast(list[DFlashLayer], list(model.layers)):
        rows = torch.cat([context, layer.input_layernorm(block)], dim=1)
        query, key, value = project_qkv(layer.self_attn, rows, positions)
        block = block + attend(layer.self_attn, query[:, :, time:], key, value, visible)
        block = block + layer.mlp(layer.post_attention_layernorm(block))
    return model.norm(block).view(batch, len(anchors), size, -1)[:, :, model.config.first_draft_row :]


def block_logits(
    model: DFlashDraft, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:  # -> [batch, anchors, drafts, vocab]
    """Every anchor's draft logits, DSpark's corrected from the target's token before each draft."""
    return model.logits(block_hidden(model, features, tokens, anchors), tokens[:, draft_offsets(model, anchors)])


def draft_offsets(model: DFlashDraft, anchors: torch.Tensor) -> torch.Tensor:  # -> [anchors, drafts]
    """Positions of the token before each draft: a + i for draft i of anchor a (its label sits at a + 1 + i)."""
    return anchors[:, None] + torch.arange(model.config.drafts_per_block)


def train_dflash(
    model: DFlashDraft,
    data: DraftData,
    features: torch.Tensor,  # [num_sequences, length, len(ids) * hidden]
    prompt_length: int,
    anchors_per_batch: int,
    settings: DraftTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
) -> DraftRecord:
    drafts = model.config.drafts_per_block
    length = data.tokens.shape[1]
    generator = torch.Generator().manual_seed(settings.seed + 1)
    choices = torch.arange(prompt_length - 1, length - drafts)

    def batch_loss(rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        picked = torch.randperm(len(choices), generator=generator)[:anchors_per_batch]
        anchors = choices[picked.sort().values]
        tokens = data.tokens[rows]
        hidden = block_hidden(model, features[rows].float(), tokens, anchors)
        previous = tokens[:, draft_offsets(model, anchors)]  # [batch, anchors, drafts]
        labels = tokens[:, draft_offsets(model, anchors) + 1]
        logits = model.logits(hidden, previous)
        loss, accuracies = step_losses(
            [logits[:, :, i] for i in range(drafts)],
            [labels[:, :, i] for i in range(drafts)],
            settings.step_decay,
            IGNORED_LABEL,
        )
        if model.confidence_head is None:
            return loss, accuracies
        correct = (logits.argmax(dim=-1) == labels).float()
        scores = model.confidence_logits(hidden.detach(), previous).float()
        return loss + binary_cross_entropy_with_logits(scores, correct), accuracies

    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    label = "dflash" if model.config.dspark is None else "dspark"
    return train_head(model, trained, data.tokens.shape[0], batch_loss, settings, label, on_point)


def save_dflash(model: DFlashDraft, hf_config: dict[str, Any], directory: Path) -> None:
    """config.json and model.safetensors (bf16) in z-lab's layout (DSpark's: the same names, its heads' added): no
    embedding, no LM head, no `model.` prefix."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = checkpoint_tensors(model)
    save_tensors(
        {name: t for name, t in tensors.items() if not name.startswith(("embed_tokens.", "lm_head."))}, directory
    )
