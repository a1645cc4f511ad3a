"""Trains chained MTP layers (Step-3.5 style, tandem.models.mtp) for a Llama target and saves them in its format.

Data: the EAGLE3 heads' greedy continuations (training.eagle3.collect_draft_data), of which the MTP layers
take the target's PRE-norm final stream h_T (capture index num_layers) and the tokens x and greedy predictions g.

Training-time test. The runner (draft_server/mtp_runner.py) has layer k at position p consume (h_{k-1}[p], x[p+k+1])
and predict x[p+k+2], with h_{-1} = h_T and h_k layer k's pre-norm output; draft step j is layer j - 1 at the last
committed position P, and layer k's rows before P are committed rows or rows of this round's guesses. Along the path
greedy verification accepts, every guess is the target's greedy token, which in a greedy continuation is the
sequence's own next token, so every row the runner computes is the row of one causal pass over the sequence with
each layer fed the previous layer's output rows (training.dense.unrolled_mtp_outputs):
    layer k, row p: (h_{k-1}[p], x[p + k + 1])   -> label g[p + k + 1], the target's greedy token for p + k + 2
Rows whose token or label lies past the sequence end are ignored. Gradients flow through the chain, as in DeepSeek-V3's
MTP training: layer k's loss also trains the layers whose output it consumes.

The embedding and LM head are the target's (the format shares them): they are filled from the target, frozen, and
not saved, so the directory holds config.json (the target's plus num_nextn_predict_layers) and the MTP layers only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.models.mtp import MTPConfig, MTPModel
from tandem.models.registry import TargetModel, target_architecture
from training.checkpoint import checkpoint_tensors, save_tensors
from training.dense import unrolled_mtp_outputs
from training.eagle3 import IGNORED_LABEL, DraftData, shifted
from training.heads import DraftRecord, DraftTraining, step_losses, train_head
from training.target import LossPoint, OptimiserSettings


@dataclass(frozen=True)
class MTPShape:
    """The layers' shape is the target's decoder layer's (the format); only their number is chosen."""

    num_layers: int = 3

    def hf_config(self, target_config: dict[str, Any]) -> dict[str, Any]:
        return target_config | {"num_nextn_predict_layers": self.num_layers}


def mtp_training_defaults() -> DraftTraining:
    """Three 512-wide layers learn at the target's rate; their loss weights decay more slowly than the EAGLE3 chain's
    since each layer has weights of its own to train."""
    return DraftTraining(
        epochs=4,
        batch_size=8,
        num_steps=MTPShape.num_layers,
        step_decay=0.9,
        optimiser=OptimiserSettings(learning_rate=2e-3, warmup_steps=30, weight_decay=0.0),
    )


def build_mtp(hf_config: dict[str, Any], target: TargetModel, seed: int) -> MTPModel:
    """Fresh MTP layers (N(0, 0.02) weights, residual output projections scaled as the target's) on the target's
    embedding and LM head, which stay frozen."""
    model = MTPModel(MTPConfig.from_hf(hf_config))
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.num_mtp_layers)
    with torch.no_grad():
        for name, parameter in model.layers.named_parameters():
            if parameter.dim() >= 2:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.fill_shared("embed_tokens", target.model.embed_tokens.weight.detach())
    model.fill_shared("lm_head", target.lm_head.weight.detach())
    model.embed_tokens.requires_grad_(False)
    model.lm_head.requires_grad_(False)
    return model


def mtp_inputs(
    tokens: torch.Tensor,  # [batch, length] x
    argmax: torch.Tensor,  # [batch, length] g
    num_layers: int,
    pad_id: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # per layer: tokens [batch, length], labels [batch, length]
    """Layer k's token x[p + k + 1] and label g[p + k + 1] for every row p (module docstring).

    Example, length 4, layer 1: tokens [x2, x3, pad, pad], labels [g2, g3, -, -].
    """
    step_tokens = [shifted(tokens, layer + 1, pad_id) for layer in range(num_layers)]
    step_labels = [shifted(argmax, layer + 1, IGNORED_LABEL) for layer in range(num_layers)]
    return step_tokens, step_labels


def mtp_loss(
    model: MTPModel,
    target_hidden: torch.Tensor,  # [batch, length, hidden]
    step_tokens: list[torch.Tensor],  # per layer [batch, length]
    step_labels: list[torch.Tensor],  # per layer [batch, length] target ids or IGNORED_LABEL
    step_decay: float,
) -> tuple[torch.Tensor, list[float]]:  # weighted loss, per-layer accuracy over the labelled rows
    outputs = unrolled_mtp_outputs(model, target_hidden, step_tokens)
    logits = [model.compute_logits(output.normed) for output in outputs]
    return step_losses(logits, step_labels, step_decay, IGNORED_LABEL)


def train_mtp(
    model: MTPModel,
    data: DraftData,
    target_hidden: torch.Tensor,  # [num_sequences, length, hidden] h_T of data's sequences
    pad_id: int,
    settings: DraftTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
) -> DraftRecord:
    num_layers = model.config.num_mtp_layers
    if settings.num_steps != num_layers:
        raise ValueError(f"num_steps {settings.num_steps}: an MTP head trains one step per layer ({num_layers})")

    def batch_loss(rows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        step_tokens, step_labels = mtp_inputs(data.tokens[rows], data.argmax[rows], num_layers, pad_id)
        return mtp_loss(model, target_hidden[rows].float(), step_tokens, step_labels, settings.step_decay)

    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return train_head(model, trained, data.tokens.shape[0], batch_loss, settings, "mtp", on_point)


def save_mtp(model: MTPModel, hf_config: dict[str, Any], directory: Path) -> None:
    """config.json and model.safetensors (bf16) holding model.layers.{L + i}.* only: the loader skips the rest of a
    target checkpoint, and the shared tables come from the target."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    first = model.config.num_target_layers
    renames: list[tuple[str, str]] = []
    for index in range(model.config.num_mtp_layers):
        checkpoint_prefix = f"model.layers.{first + index}."
        # The decoder layer's modules sit directly under the checkpoint layer, next to enorm, hnorm, eh_proj.
        renames += [(f"{index}.decoder.", checkpoint_prefix), (f"{index}.", checkpoint_prefix)]
    packed = target_architecture(model.config.target.architecture).name_map.packed
    save_tensors(checkpoint_tensors(model.layers, tuple(renames), packed=packed), directory)
