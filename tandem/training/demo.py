"""Trains the bundled demo pair from scratch: `python -m tandem.training.demo --out DIR [--budget-minutes N]`.

Stages, each with a progress bar and its wall time recorded in DIR/metadata.json:
    corpus      the interpreter's standard library split into train / held-out packages (tandem.training.data)
    tokenizer   byte-level BPE trained on the train split only
    target      a Llama-architecture code model trained on the train split          -> DIR/target/
    data        greedy continuations of held-in prompts by the saved target, with its aux features
    eagle3      an EAGLE3 head trained on them with the unrolled chain (training-time test) -> DIR/eagle3/
    evaluate    greedy acceptance length with k = 5 on held-out prompts, and step timings (serving runners)
The loss curves go to DIR/loss_curve.json and DIR/loss_curve.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tandem.training.data import (
    END_OF_TEXT,
    HELD_OUT_PACKAGES,
    PAD,
    encode_documents,
    pack_blocks,
    read_sources,
    sample_prompts,
    split_corpus,
    stdlib_root,
    token_id,
    train_tokenizer,
)
from tandem.training.eagle3 import (
    DraftShape,
    DraftTraining,
    build_draft,
    capture_indices,
    collect_draft_data,
    draft_vocabulary,
    save_draft,
    target_to_draft_map,
    train_draft,
)
from tandem.training.evaluate import measure_acceptance
from tandem.training.target import (
    LossPoint,
    TargetShape,
    TargetTraining,
    build_target,
    load_llama_target,
    save_target,
    train_target,
)

LOG = logging.getLogger("tandem.training.demo")


@dataclass(frozen=True)
class DemoSettings:
    budget_minutes: float = 60.0
    target_budget_share: float = 0.5  # of the whole budget; the rest goes to the data, the head and evaluation
    draft_budget_share: float = 0.22
    target_shape: TargetShape = field(default_factory=TargetShape)
    draft_shape: DraftShape = field(default_factory=DraftShape)
    target_training: TargetTraining = field(default_factory=TargetTraining)
    draft_training: DraftTraining = field(default_factory=DraftTraining)
    num_continuations: int = 1536  # held-in prompts continued by the target for the head's training data
    continuation_prompt_tokens: int = 64
    continuation_new_tokens: int = 192
    continuation_batch: int = 64
    num_eval_prompts: int = 16
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 128
    eval_num_steps: int = 5
    held_out_eval_blocks: int = 32
    seed: int = 0

    def scaled(self) -> DemoSettings:
        """Stage budgets from the total; a budget under the default one also shrinks the head's data set."""
        budget = 60.0 * self.budget_minutes
        share = min(1.0, self.budget_minutes / DemoSettings.budget_minutes)
        return replace(
            self,
            target_training=replace(self.target_training, budget_seconds=budget * self.target_budget_share),
            draft_training=replace(self.draft_training, budget_seconds=budget * self.draft_budget_share),
            num_continuations=max(self.continuation_batch, int(self.num_continuations * share)),
        )


@dataclass
class StageClock:
    seconds: dict[str, float]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        LOG.info("stage %s ...", name)
        started = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - started, 1)
        LOG.info("stage %s done in %.1f s", name, self.seconds[name])


def run_demo(out: Path, settings: DemoSettings) -> dict[str, Any]:
    """Runs every stage; returns the metadata also written to out/metadata.json."""
    torch.manual_seed(settings.seed)
    clock = StageClock({})
    target_dir, draft_dir = out / "target", out / "eagle3"
    curves: dict[str, list[LossPoint]] = {"target": [], "eagle3": []}

    with clock.stage("corpus"):
        split = split_corpus(stdlib_root(), HELD_OUT_PACKAGES)
        train_texts = list(read_sources(split.train))
        held_out_texts = list(read_sources(split.held_out))
    with clock.stage("tokenizer"):
        tokenizer = train_tokenizer(train_texts, settings.target_shape.vocab_size)
        end_id = token_id(tokenizer, END_OF_TEXT)
        train_stream = encode_documents(tokenizer, train_texts)
        held_out_stream = encode_documents(tokenizer, held_out_texts)
    block = settings.target_training.block_length + 1
    train_blocks = pack_blocks(train_stream, block)
    held_out_blocks = pack_blocks(held_out_stream, block)[: settings.held_out_eval_blocks]

    target_config = settings.target_shape.hf_config(end_id, token_id(tokenizer, PAD))
    with clock.stage("target"):
        target = build_target(target_config, settings.seed)
        target_record = train_target(
            target, train_blocks, held_out_blocks, settings.target_training, curves["target"].append
        )
        save_target(target, target_config, tokenizer, target_dir)
    del target

    with clock.stage("data"):
        # The head learns the target as served: the saved (bf16-rounded) weights, read back by the serving loader.
        served_target = load_llama_target(target_dir)
        capture = capture_indices(settings.draft_shape, served_target.config.num_layers)
        prompts = sample_prompts(
            train_stream, settings.num_continuations, settings.continuation_prompt_tokens, settings.seed, end_id
        )
        data = collect_draft_data(
            served_target,
            prompts,
            settings.continuation_new_tokens,
            capture,
            settings.continuation_batch,
            settings.draft_training.bf16_autocast,
        )
        del served_target
        counts = torch.bincount(data.argmax.flatten(), minlength=settings.target_shape.vocab_size)
        draft_to_target = draft_vocabulary(counts, settings.draft_shape.draft_vocab_size)
        coverage = float(counts[draft_to_target].sum()) / float(counts.sum())

    draft_config = settings.draft_shape.hf_config(target_config)
    with clock.stage("eagle3"):
        draft = build_draft(draft_config, draft_to_target, settings.seed)
        target_to_draft = target_to_draft_map(draft_to_target, settings.target_shape.vocab_size)
        draft_record = train_draft(
            draft,
            data,
            target_to_draft,
            token_id(tokenizer, PAD),
            settings.draft_training,
            curves["eagle3"].append,
        )
        save_draft(draft, draft_config, draft_dir)

    with clock.stage("evaluate"):
        eval_prompts = sample_prompts(
            held_out_stream, settings.num_eval_prompts, settings.eval_prompt_tokens, settings.seed + 1, end_id
        )
        acceptance = measure_acceptance(
            target_dir, draft_dir, eval_prompts.tolist(), settings.eval_num_steps, settings.eval_new_tokens
        )

    metadata: dict[str, Any] = {
        "command": f"python -m tandem.training.demo --out {out} --budget-minutes {settings.budget_minutes:g}",
        "torch_threads": torch.get_num_threads(),
        "held_out_packages": list(HELD_OUT_PACKAGES),
        "corpus": {
            "stdlib": str(split.root),
            "train_files": len(split.train),
            "held_out_files": len(split.held_out),
            "train_tokens": int(train_stream.numel()),
            "held_out_tokens": int(held_out_stream.numel()),
        },
        "seeds": {"everything": settings.seed, "eval_prompts": settings.seed + 1},
        "settings": asdict(settings),
        "stage_seconds": clock.seconds,
        "target": {
            "steps": target_record.steps_done,
            "tokens_seen": target_record.steps_done * settings.target_training.batch_size * (block - 1),
            "final_train_loss": round(target_record.final_loss, 4),
            "held_out_loss": round(target_record.held_out_loss, 4),
        },
        "eagle3": {
            "steps": draft_record.steps_done,
            "sequences": int(data.tokens.shape[0]),
            "final_loss": round(draft_record.final_loss, 4),
            "train_step_accuracy": [round(value, 4) for value in draft_record.step_accuracy],
            "capture_indices": list(capture),
            "draft_vocab_coverage": round(coverage, 4),
        },
        "acceptance": asdict(acceptance),
        "file_megabytes": {
            path.name: round(sum(f.stat().st_size for f in path.iterdir()) / 1e6, 2) for path in (target_dir, draft_dir)
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    write_curves(out, curves, curve_notes(settings.draft_training))
    return metadata


def curve_notes(draft_training: DraftTraining) -> dict[str, str]:
    """What each curve's loss is, for the Markdown table."""
    weights = sum(draft_training.step_decay**step for step in range(draft_training.num_steps))
    return {
        "target": "Next-token cross-entropy (nats) on the training blocks.",
        "eagle3": f"Chain loss: cross-entropy (nats) of each of the {draft_training.num_steps} unrolled steps against "
        f"the target's greedy token, step j weighted {draft_training.step_decay} ** j, summed (weights sum to "
        f"{weights:.2f}).",
    }


def write_curves(out: Path, curves: dict[str, list[LossPoint]], notes: dict[str, str], rows: int = 20) -> None:
    """The full curves as JSON, and about `rows` evenly spaced points per stage as a Markdown table."""
    (out / "loss_curve.json").write_text(
        json.dumps(
            {name: [[p.step, round(p.seconds, 2), round(p.loss, 4)] for p in points] for name, points in curves.items()}
        )
        + "\n"
    )
    lines = ["# Loss curves", ""]
    for name, points in curves.items():
        lines += [
            f"## {name}",
            "",
            notes[name],
            "",
            "| step | seconds | loss (mean of 10 steps) |",
            "|---:|---:|---:|",
        ]
        stride = max(1, len(points) // rows)
        for end in range(stride, len(points) + 1, stride):
            window = points[max(0, end - 10) : end]
            mean = sum(p.loss for p in window) / len(window)
            lines.append(f"| {points[end - 1].step} | {points[end - 1].seconds:.0f} | {mean:.3f} |")
        lines.append("")
    (out / "loss_curve.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the demo target and its EAGLE3 head from scratch.")
    parser.add_argument("--out", type=Path, required=True, help="output directory (target/, eagle3/, metadata)")
    parser.add_argument("--budget-minutes", type=float, default=DemoSettings.budget_minutes)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    metadata = run_demo(args.out, DemoSettings(budget_minutes=args.budget_minutes).scaled())
    LOG.info("done: %s", json.dumps({key: metadata[key] for key in ("stage_seconds", "target", "eagle3")}))
    LOG.info("acceptance: %s", json.dumps(metadata["acceptance"]))


if __name__ == "__main__":
    main()
