"""The training loop shared by the draft heads (EAGLE3 heads of either layer kind, chained MTP layers).

Each head brings its own loss over a batch of sequences (the chain it runs at serving time, unrolled); the loop
brings what must be the same for all of them: AdamW with the target's schedule (training.target), a wall-time
budget, a progress bar, the loss curve and the per-step accuracy of the last batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from training.target import LossPoint, OptimiserSettings, training_progress

# A batch's loss: sequence rows [batch] -> (scalar loss to minimise, accuracy per chain step on labelled rows).
BatchLoss = Callable[[torch.Tensor], tuple[torch.Tensor, list[float]]]


@dataclass(frozen=True)
class DraftTraining:
    epochs: int = 6
    batch_size: int = 16
    num_steps: int = 5  # chain steps unrolled, the k the head is meant for (for MTP: its layers)
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


def draw_matrices(model: nn.Module, seed: int) -> None:
    """A fresh head's initial weights: every matrix N(0, 0.02) from a generator of `seed`, in parameter order;
    vectors (norms, biases) stay as built."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)


def train_head(
    model: nn.Module,
    parameters: Iterable[nn.Parameter],  # the trained ones; shared tables of the target stay frozen
    num_sequences: int,
    batch_loss: BatchLoss,
    settings: DraftTraining,
    label: str,  # the progress bar's name
    on_point: Callable[[LossPoint], None] = lambda point: None,
) -> DraftRecord:
    """Runs `settings.epochs` epochs of shuffled batches, or stops earlier at the wall-time budget."""
    trained = list(parameters)
    generator = torch.Generator().manual_seed(settings.seed)
    optimiser = torch.optim.AdamW(
        trained,
        lr=settings.optimiser.learning_rate,
        betas=(0.9, 0.95),
        weight_decay=settings.optimiser.weight_decay,
    )
    batches_per_epoch = num_sequences // settings.batch_size
    total_steps = settings.epochs * batches_per_epoch
    model.train()
    curve: list[LossPoint] = []
    recent_accuracy: list[list[float]] = []
    start = time.monotonic()
    progress_bar = tqdm(total=total_steps, desc=label, unit="step")
    step = 0
    while training_progress(step, total_steps, time.monotonic() - start, settings.budget_seconds) < 1.0:
        if step % batches_per_epoch == 0:
            order = torch.randperm(num_sequences, generator=generator)
        rows = order[(step % batches_per_epoch) * settings.batch_size :][: settings.batch_size]
        progress = training_progress(step, total_steps, time.monotonic() - start, settings.budget_seconds)
        for group in optimiser.param_groups:
            group["lr"] = settings.optimiser.rate(step, progress)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
            loss, accuracies = batch_loss(rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, settings.optimiser.gradient_clip)
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
    model.eval()
    tail = curve[-20:]
    return DraftRecord(
        steps_done=step,
        seconds=time.monotonic() - start,
        curve=tuple(curve),
        final_loss=sum(p.loss for p in tail) / max(len(tail), 1),
        step_accuracy=tuple(sum(column) / len(column) for column in zip(*recent_accuracy, strict=True)),
    )


def step_losses(
    step_logits: list[torch.Tensor],  # per chain step [batch, time, vocab]
    step_labels: list[torch.Tensor],  # per chain step [batch, time] ids in the logits' vocabulary, or ignore_index
    step_decay: float,
    ignore_index: int,
) -> tuple[torch.Tensor, list[float]]:  # weighted loss, per-step accuracy over the labelled rows
    """Cross-entropy of every chain step, step j weighted step_decay ** j and summed (EAGLE-3's chain loss)."""
    total = torch.zeros(())
    accuracies = []
    for step, (logits, labels) in enumerate(zip(step_logits, step_labels, strict=True)):
        total = total + step_decay**step * torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=ignore_index
        )
        labelled = labels != ignore_index
        correct = (logits.argmax(dim=-1) == labels) & labelled
        accuracies.append(float(correct.sum()) / max(int(labelled.sum()), 1))
    return total, accuracies
