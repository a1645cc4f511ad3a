"""The demo's draft heads, by name: what each takes of the collected data, how it trains, and what it is scored on.

    eagle3      EAGLE3 head with a Llama layer (SpecForge layout), unrolled chain of training.eagle3
    eagle3-mla  EAGLE3 head with an MLA layer (Eagle3DeepseekV2ForCausalLM, Kimi-K2.5 layout), the same chain
    mtp         chained MTP layers (Step-3.5 style, training.mtp), one draft step per layer
    dflash      a DFlash block drafter (z-lab layout, training.dflash), a block of drafts per forward
    dspark      a DSpark block drafter (DeepSpec layout): the same backbone, every row drafting, a Markov head and a
                confidence head

Every head is trained on the same greedy continuations of the served target (training.demo's data stage),
collected once at the union of the heads' capture indices; each head takes its own columns (captured_features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.models.dflash import feature_capture
from tandem.models.registry import TargetModel
from training.dflash import (
    DFlashShape,
    DSparkShape,
    build_dflash,
    dflash_training_defaults,
    save_dflash,
    train_dflash,
)
from training.eagle3 import (
    DraftData,
    DraftShape,
    LatentAttentionShape,
    build_draft,
    capture_indices,
    captured_features,
    draft_vocabulary,
    save_draft,
    target_to_draft_map,
    train_draft,
)
from training.heads import DraftRecord, DraftTraining
from training.mtp import MTPShape, build_mtp, mtp_training_defaults, save_mtp, train_mtp
from training.target import LossPoint


def mla_draft_shape() -> DraftShape:
    """As narrow as the Llama head (256 wide, draft vocabulary 2048); 8 heads of 32 + 32 query/key dims over a
    64-wide latent, so that one draft step stays a small fraction of a target step."""
    return DraftShape(num_heads=8, num_kv_heads=8, latent_attention=LatentAttentionShape())


@dataclass(frozen=True)
class HeadSettings:
    draft_shape: DraftShape = field(default_factory=DraftShape)
    mla_draft_shape: DraftShape = field(default_factory=mla_draft_shape)
    mtp_shape: MTPShape = field(default_factory=MTPShape)
    draft_training: DraftTraining = field(default_factory=DraftTraining)  # both EAGLE3 heads
    mtp_training: DraftTraining = field(default_factory=mtp_training_defaults)
    dflash_shape: DFlashShape = field(default_factory=DFlashShape)
    dflash_training: DraftTraining = field(default_factory=dflash_training_defaults)
    dflash_anchors: int = 16  # anchors (blocks) per sequence per batch, DSpark's too
    dspark_shape: DSparkShape = field(default_factory=DSparkShape)
    dspark_training: DraftTraining = field(default_factory=dflash_training_defaults)
    eval_num_steps: int = 5  # k of the acceptance measurement; an MTP head drafts at most one step per layer
    seed: int = 0


@dataclass(frozen=True)
class HeadContext:
    """What a head's training reads: the served target and its greedy continuations with their features."""

    settings: HeadSettings
    target: TargetModel
    target_config: dict[str, Any]  # the target's config.json
    data: DraftData
    capture: tuple[int, ...]  # the capture indices data.features was collected at, in order
    pad_id: int
    prompt_length: int  # of every sequence in data; the rest is the target's greedy continuation


@dataclass(frozen=True)
class DemoHead:
    capture: Callable[[HeadSettings, int], tuple[int, ...]]  # (settings, target layers) -> capture indices
    train: Callable[[HeadContext, Path, Callable[[LossPoint], None]], dict[str, Any]]  # saves to the directory
    num_steps: Callable[[HeadSettings], int]  # k of the acceptance measurement
    note: Callable[[HeadSettings], str]  # what the loss curve's loss is


def record_summary(record: DraftRecord, data: DraftData) -> dict[str, Any]:
    return {
        "steps": record.steps_done,
        "seconds": round(record.seconds, 1),
        "sequences": int(data.tokens.shape[0]),
        "final_loss": round(record.final_loss, 4),
        "train_step_accuracy": [round(value, 4) for value in record.step_accuracy],
    }


def train_eagle3_head(
    shape: DraftShape, label: str, context: HeadContext, directory: Path, on_point: Callable[[LossPoint], None]
) -> dict[str, Any]:
    settings, data = context.settings, context.data
    vocab_size = context.target.config.vocab_size
    capture = capture_indices(shape, context.target.config.num_layers)
    counts = torch.bincount(data.argmax.flatten(), minlength=vocab_size)
    draft_to_target = draft_vocabulary(counts, shape.draft_vocab_size)
    hf_config = shape.hf_config(context.target_config)
    draft = build_draft(hf_config, draft_to_target, settings.seed)
    record = train_draft(
        draft,
        data,
        target_to_draft_map(draft_to_target, vocab_size),
        context.pad_id,
        settings.draft_training,
        on_point,
        features=captured_features(data.features, context.capture, capture),
        label=label,
    )
    save_draft(draft, hf_config, directory)
    return record_summary(record, data) | {
        "capture_indices": list(capture),
        "draft_vocab_coverage": round(float(counts[draft_to_target].sum()) / float(counts.sum()), 4),
    }


def train_mtp_head(context: HeadContext, directory: Path, on_point: Callable[[LossPoint], None]) -> dict[str, Any]:
    settings = context.settings
    capture = context.target.config.num_layers  # the pre-norm final stream
    hf_config = settings.mtp_shape.hf_config(context.target_config)
    model = build_mtp(hf_config, context.target, settings.seed)
    hidden = captured_features(context.data.features, context.capture, (capture,))
    record = train_mtp(model, context.data, hidden, context.pad_id, settings.mtp_training, on_point)
    save_mtp(model, hf_config, directory)
    return record_summary(record, context.data) | {"capture_indices": [capture], "chain": True}


def train_block_head(
    shape: DFlashShape,
    training: DraftTraining,
    context: HeadContext,
    directory: Path,
    on_point: Callable[[LossPoint], None],
) -> dict[str, Any]:
    settings = context.settings
    # The mask token is the padding token: the frozen target embedding's row of a token no text holds.
    hf_config = shape.hf_config(context.target_config, context.pad_id)
    model = build_dflash(hf_config, context.target, settings.seed)
    capture = feature_capture(shape.target_layer_ids, context.target.config.num_layers)
    features = captured_features(context.data.features, context.capture, capture)
    record = train_dflash(
        model, context.data, features, context.prompt_length, settings.dflash_anchors, training, on_point
    )
    save_dflash(model, hf_config, directory)
    return record_summary(record, context.data) | {"capture_indices": list(capture), "block_size": shape.block_size}


def block_demo_head(
    shape: Callable[[HeadSettings], DFlashShape], training: Callable[[HeadSettings], DraftTraining]
) -> DemoHead:
    """A block drafter's demo head; its acceptance is measured at a whole block's drafts."""
    return DemoHead(
        capture=lambda settings, layers: feature_capture(shape(settings).target_layer_ids, layers),
        train=lambda context, directory, on_point: train_block_head(
            shape(context.settings), training(context.settings), context, directory, on_point
        ),
        num_steps=lambda settings: shape(settings).drafts_per_round,
        note=lambda settings: chain_note(training(settings), "block positions (one forward)"),
    )


def chain_note(training: DraftTraining, steps: str) -> str:
    weights = sum(training.step_decay**step for step in range(training.num_steps))
    return (
        f"Chain loss: cross-entropy (nats) of each of the {training.num_steps} {steps} against the target's greedy "
        f"token, step j weighted {training.step_decay} ** j, summed (weights sum to {weights:.2f})."
    )


def eagle3_demo_head(name: str, shape: Callable[[HeadSettings], DraftShape]) -> DemoHead:
    """An EAGLE3 demo head of the layer kind `shape` picks; both kinds share draft_training and the k measured."""
    return DemoHead(
        capture=lambda settings, layers: capture_indices(shape(settings), layers),
        train=lambda context, directory, on_point: train_eagle3_head(
            shape(context.settings), name, context, directory, on_point
        ),
        num_steps=lambda settings: settings.eval_num_steps,
        note=lambda settings: chain_note(settings.draft_training, "unrolled steps"),
    )


DEMO_HEADS: dict[str, DemoHead] = {
    "eagle3": eagle3_demo_head("eagle3", lambda settings: settings.draft_shape),
    "eagle3-mla": eagle3_demo_head("eagle3-mla", lambda settings: settings.mla_draft_shape),
    "mtp": DemoHead(
        capture=lambda settings, layers: (layers,),
        train=train_mtp_head,
        num_steps=lambda settings: min(settings.eval_num_steps, settings.mtp_shape.num_layers),
        note=lambda settings: chain_note(settings.mtp_training, "chained MTP layers (full vocabulary)"),
    ),
    "dflash": block_demo_head(lambda settings: settings.dflash_shape, lambda settings: settings.dflash_training),
    "dspark": block_demo_head(lambda settings: settings.dspark_shape, lambda settings: settings.dspark_training),
}
