"""Trains an EAGLE3 head for a target, on the target's own greedy continuations, and saves it in SpecForge format.

Data: held-in prompts continued greedily by the target; for every position t of a sequence x we keep the target's
aux features f[t] and its greedy prediction g[t] (the token the target would put at t + 1).

Training-time test (EAGLE-3): the chain the draft server runs (draft_server/runner.py) is unrolled for every anchor
p at once (tandem.training.dense.unrolled_draft_logits):
    step 0  row of anchor p: (f[p], x[p + 1]), attends causally to ingested rows   -> label g[p + 1]
    step j  row at position p + j: (draft hidden of step j - 1, g[p + j])            -> label g[p + j + 1]
At inference the token of step j is the draft's own guess d_j; along the accepted path it equals g[p + j], so the
labels are exactly what greedy verification accepts. Labels outside the draft vocabulary are ignored.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tandem.models.aux_layers import resolve_capture
from tandem.models.eagle3 import Eagle3Config, Eagle3Draft
from tandem.models.llama import LlamaForCausalLM
from tandem.training.checkpoint import checkpoint_tensors, save_tensors
from tandem.training.dense import unrolled_draft_logits
from tandem.training.target import LossPoint, OptimiserSettings, greedy_generate, training_progress

IGNORED_LABEL = -100
# Checkpoint prefixes of the SpecForge layout, the inverse of tandem.models.eagle3.EAGLE3_NAME_MAP.
EAGLE3_EXPORT_RENAMES = (("hidden_norm.", "midlayer.hidden_norm."), ("layer.", "midlayer."))


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

    def hf_config(self, target_config: dict[str, Any]) -> dict[str, Any]:
        config: dict[str, Any] = {
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
            "rope_theta": _rope_theta(target_config),
            "rope_scaling": None,
            "max_position_embeddings": target_config["max_position_embeddings"],
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


@dataclass(frozen=True)
class DraftData:
    tokens: torch.Tensor  # [num_sequences, length] x
    argmax: torch.Tensor  # [num_sequences, length] g: g[:, t] is the target's greedy token for position t + 1
    features: torch.Tensor  # [num_sequences, length, num_aux * target_hidden] bf16


@dataclass(frozen=True)
class DraftTraining:
    epochs: int = 6
    batch_size: int = 16
    num_steps: int = 5  # chain steps unrolled, the k the head is meant for
    step_decay: float = 0.8  # loss weight of step j is step_decay ** j (EAGLE-3)
    optimiser: OptimiserSettings = field(
        default_factory=lambda: OptimiserSettings(learning_rate=3e-3, warmup_steps=50, weight_decay=0.0)
    )
    budget_seconds: float = 15 * 60.0
    bf16_autocast: bool = True
    seed: int = 0


@dataclass(frozen=True)
class DraftRecord:
    steps_done: int
    seconds: float
    curve: tuple[LossPoint, ...]
    final_loss: float
    step_accuracy: tuple[float, ...]  # per chain step: draft argmax == label, on the last batches


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
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
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
        step_tokens.append(_shifted(source, shift, pad_id))
        labels = _shifted(argmax, step + 1, 0)
        labels = target_to_draft[labels]
        labels[:, max(length - step - 1, 0) :] = IGNORED_LABEL
        step_labels.append(labels)
    return step_tokens, step_labels


def _shifted(values: torch.Tensor, shift: int, fill: int) -> torch.Tensor:  # [batch, length] -> values[:, p + shift]
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
    total = torch.zeros(())
    accuracies = []
    for step, (step_logits, labels) in enumerate(zip(logits, step_labels, strict=True)):
        total = total + step_decay**step * F.cross_entropy(
            step_logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORED_LABEL
        )
        labelled = labels != IGNORED_LABEL
        correct = (step_logits.argmax(dim=-1) == labels) & labelled
        accuracies.append(float(correct.sum()) / max(int(labelled.sum()), 1))
    return total, accuracies


def train_draft(
    draft: Eagle3Draft,
    data: DraftData,
    target_to_draft: torch.Tensor,  # [vocab]
    pad_id: int,
    settings: DraftTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
) -> DraftRecord:
    generator = torch.Generator().manual_seed(settings.seed)
    optimiser = torch.optim.AdamW(
        draft.parameters(),
        lr=settings.optimiser.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=settings.optimiser.weight_decay,
    )
    num_sequences = data.tokens.shape[0]
    batches_per_epoch = num_sequences // settings.batch_size
    total_steps = settings.epochs * batches_per_epoch
    draft.train()
    curve: list[LossPoint] = []
    recent_accuracy: list[list[float]] = []
    start = time.monotonic()
    progress_bar = tqdm(total=total_steps, desc="eagle3", unit="step")
    step = 0
    while training_progress(step, total_steps, time.monotonic() - start, settings.budget_seconds) < 1.0:
        if step % batches_per_epoch == 0:
            order = torch.randperm(num_sequences, generator=generator)
        rows = order[(step % batches_per_epoch) * settings.batch_size :][: settings.batch_size]
        progress = training_progress(step, total_steps, time.monotonic() - start, settings.budget_seconds)
        for group in optimiser.param_groups:
            group["lr"] = settings.optimiser.rate(step, progress)
        step_tokens, step_labels = chain_inputs(
            data.tokens[rows], data.argmax[rows], settings.num_steps, target_to_draft, pad_id
        )
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
            loss, accuracies = chain_loss(
                draft, data.features[rows].float(), step_tokens, step_labels, settings.step_decay
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), settings.optimiser.gradient_clip)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        point = LossPoint(step, time.monotonic() - start, loss.item())
        curve.append(point)
        on_point(point)
        recent_accuracy = [*recent_accuracy[-19:], accuracies]
        step += 1
        progress_bar.update(1)
        progress_bar.set_postfix(loss=f"{point.loss:.3f}", first=f"{accuracies[0]:.2f}", last=f"{accuracies[-1]:.2f}")
    progress_bar.close()
    draft.eval()
    tail = curve[-20:]
    return DraftRecord(
        steps_done=step,
        seconds=time.monotonic() - start,
        curve=tuple(curve),
        final_loss=sum(p.loss for p in tail) / max(len(tail), 1),
        step_accuracy=tuple(sum(column) / len(column) for column in zip(*recent_accuracy, strict=True)),
    )


def save_draft(draft: Eagle3Draft, hf_config: dict[str, Any], directory: Path) -> None:
    """config.json and model.safetensors (bf16) in the SpecForge layout, with d2t, t2d and the draft's embedding.

    The embedding is stored because the draft's hidden size differs from the target's, so the target's table
    cannot be shared.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tensors = checkpoint_tensors(draft, EAGLE3_EXPORT_RENAMES)
    in_draft = torch.zeros(draft.config.layer.vocab_size, dtype=torch.bool)
    in_draft[draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))] = True
    tensors["t2d"] = in_draft
    save_tensors(tensors, directory)


def _rope_theta(target_config: dict[str, Any]) -> float:
    parameters = target_config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", target_config.get("rope_theta", 10000.0)))
