"""Trains the demo target: a Llama-architecture causal LM, built from the config.json it is saved with.

The model is tandem.models.llama.LlamaForCausalLM, the class the target server runs; training drives it through the
dense forward of training.dense. Weights are stored in the Hugging Face layout, so transformers'
AutoModelForCausalLM reads the same files.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from tandem.models.config import ModelConfig
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from training.checkpoint import checkpoint_tensors, save_tensors
from training.dense import DenseKV, target_forward


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 6
    num_heads: int = 8
    num_kv_heads: int = 8
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def hf_config(self, end_of_text_id: int, pad_id: int) -> dict[str, Any]:
        """The config.json the target is saved with, as transformers writes it."""
        config = LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=False,
            bos_token_id=end_of_text_id,
            eos_token_id=end_of_text_id,
            pad_token_id=pad_id,
            dtype="bfloat16",
        )
        result: dict[str, Any] = config.to_dict()
        return result


@dataclass(frozen=True)
class OptimiserSettings:
    """AdamW with linear warmup and cosine decay; the schedule runs on progress in [0, 1] (see training_progress)."""

    learning_rate: float
    warmup_steps: int
    weight_decay: float = 0.1
    final_fraction: float = 0.1  # the learning rate ends at this fraction of its peak
    gradient_clip: float = 1.0

    def rate(self, step: int, progress: float) -> float:
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return self.learning_rate * (self.final_fraction + (1.0 - self.final_fraction) * cosine)


@dataclass(frozen=True)
class TargetTraining:
    steps: int = 1500
    batch_size: int = 16
    block_length: int = 256  # tokens per training sequence
    optimiser: OptimiserSettings = OptimiserSettings(learning_rate=2e-3, warmup_steps=100)
    budget_seconds: float = 35 * 60.0  # training stops at steps or at this wall time, whichever comes first
    bf16_autocast: bool = True
    seed: int = 0


@dataclass(frozen=True)
class LossPoint:
    step: int
    seconds: float
    loss: float


@dataclass(frozen=True)
class TrainingRecord:
    steps_done: int
    seconds: float
    curve: tuple[LossPoint, ...]
    final_loss: float  # mean of the last steps' training losses
    held_out_loss: float  # mean loss on held-out blocks after training


def target_summary(record: TrainingRecord, settings: TargetTraining) -> dict[str, Any]:
    """What the metadata records of a target's training."""
    return {
        "steps": record.steps_done,
        "tokens_seen": record.steps_done * settings.batch_size * settings.block_length,
        "final_train_loss": round(record.final_loss, 4),
        "held_out_loss": round(record.held_out_loss, 4),
    }


def training_progress(step: int, steps: int, elapsed: float, budget_seconds: float) -> float:
    """The larger of the step fraction and the time fraction, so the schedule completes whichever limit binds."""
    return max(step / steps, elapsed / budget_seconds)


def load_llama_target(model_dir: Path) -> LlamaForCausalLM:
    """The saved target, read by the serving loader; training drives Llama-family modules, so others are refused."""
    model = load_target(model_dir)
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"{model_dir}: training needs a Llama-family target, got {type(model).__name__}")
    return model


def build_target(hf_config: dict[str, Any], seed: int) -> LlamaForCausalLM:
    """A freshly initialised target: N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 * layers)."""
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_config))
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() < 2:
                continue  # norm weights stay at 1
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model


def language_model_loss(
    model: LlamaForCausalLM,
    blocks: torch.Tensor,  # [batch, length + 1] token ids
) -> torch.Tensor:  # scalar mean next-token cross-entropy
    output = target_forward(model, blocks[:, :-1])
    logits = model.lm_head(output.normed)  # [batch, length, vocab]
    return F.cross_entropy(logits.flatten(0, 1).float(), blocks[:, 1:].flatten())


# A model's scalar mean next-token cross-entropy on blocks [batch, length + 1].
BlockLoss = Callable[[Any, torch.Tensor], torch.Tensor]


def train_target(
    model: nn.Module,
    train_blocks: torch.Tensor,  # [num_blocks, block_length + 1]
    held_out_blocks: torch.Tensor,  # [num_held_out, block_length + 1]
    settings: TargetTraining,
    on_point: Callable[[LossPoint], None] = lambda point: None,
    loss_of: BlockLoss = language_model_loss,  # the model's next-token loss on a batch of blocks
) -> TrainingRecord:
    generator = torch.Generator().manual_seed(settings.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimiser = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.optimiser.weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=settings.optimiser.learning_rate,
        betas=(0.9, 0.95),
    )
    model.train()
    curve: list[LossPoint] = []
    order = torch.randperm(train_blocks.shape[0], generator=generator)
    cursor = 0
    start = time.monotonic()
    progress_bar = tqdm(total=settings.steps, desc="target", unit="step")
    step = 0
    while training_progress(step, settings.steps, time.monotonic() - start, settings.budget_seconds) < 1.0:
        if cursor + settings.batch_size > order.numel():
            order, cursor = torch.randperm(train_blocks.shape[0], generator=generator), 0
        batch = train_blocks[order[cursor : cursor + settings.batch_size]]
        cursor += settings.batch_size
        progress = training_progress(step, settings.steps, time.monotonic() - start, settings.budget_seconds)
        for group in optimiser.param_groups:
            group["lr"] = settings.optimiser.rate(step, progress)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.optimiser.gradient_clip)
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        point = LossPoint(step, time.monotonic() - start, loss.item())
        curve.append(point)
        on_point(point)
        step += 1
        progress_bar.update(1)
        progress_bar.set_postfix(loss=f"{point.loss:.3f}")
    progress_bar.close()
    model.eval()
    tail = curve[-20:]
    return TrainingRecord(
        steps_done=step,
        seconds=time.monotonic() - start,
        curve=tuple(curve),
        final_loss=sum(p.loss for p in tail) / max(len(tail), 1),
        held_out_loss=evaluate_loss(model, held_out_blocks, settings.batch_size, settings.bf16_autocast, loss_of),
    )


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    blocks: torch.Tensor,  # [num_blocks, length + 1]
    batch_size: int,
    bf16_autocast: bool,
    loss_of: BlockLoss = language_model_loss,
) -> float:
    losses = []
    for first in range(0, blocks.shape[0], batch_size):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            losses.append(float(loss_of(model, blocks[first : first + batch_size])))
    return sum(losses) / max(len(losses), 1)


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM,
    prompts: torch.Tensor,  # [batch, prompt_length]
    num_new: int,
    capture: tuple[int, ...] = (),
    bf16_autocast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy continuation of equally long prompts with a dense KV cache.

    Returns (tokens [batch, prompt_length + num_new], argmax [batch, prompt_length + num_new] where argmax[:, t] is
    the target's greedy prediction for position t + 1, features [batch, same, len(capture) * hidden] or None).
    """
    cache = DenseKV()
    inputs = prompts
    tokens = [prompts]
    argmaxes, features = [], []
    for _ in range(num_new + 1):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            output = target_forward(model, inputs, capture, cache)
            predicted = model.lm_head(output.normed).argmax(dim=-1)  # [batch, rows]
        argmaxes.append(predicted)
        if capture:
            features.append(torch.cat([output.captured[index] for index in capture], dim=-1).to(torch.bfloat16))
        inputs = predicted[:, -1:]
        tokens.append(inputs)
    # The last pass scored the final generated token; its own successor is dropped from the tokens.
    all_tokens = torch.cat(tokens[:-1], dim=1)
    return all_tokens, torch.cat(argmaxes, dim=1), torch.cat(features, dim=1) if capture else None


def save_target(
    model: LlamaForCausalLM,
    hf_config: dict[str, Any],
    tokenizer: PreTrainedTokenizerFast,
    directory: Path,
) -> None:
    """config.json, model.safetensors (bf16), generation_config.json and the tokenizer files."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_tensors(checkpoint_tensors(model), directory)
    GenerationConfig(
        bos_token_id=hf_config["bos_token_id"],
        eos_token_id=hf_config["eos_token_id"],
        pad_token_id=hf_config["pad_token_id"],
    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
