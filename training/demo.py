"""Trains the bundled demo pair from scratch: `python -m training.demo --out DIR [--budget-minutes N]`.

Stages, each with a progress bar and its wall time recorded in DIR/metadata.json:
    corpus      the interpreter's standard library split into train / held-out packages (training.data)
    tokenizer   byte-level BPE trained on the train split only
    target      a Llama-architecture code model trained on the train split                  -> DIR/target/
    data        greedy continuations of held-in prompts by the saved target, with the aux features of every head
    eagle3      an EAGLE3 head (Llama layer) trained with the unrolled chain (training-time test) -> DIR/eagle3/
    eagle3-mla  an EAGLE3 head with an MLA layer (Kimi-K2.5 layout), the same chain             -> DIR/eagle3-mla/
    mtp         3 chained MTP layers (Step-3.5 style), each on the previous one's outputs       -> DIR/mtp/
    dflash      a DFlash block drafter (2 layers, block 8), all of a block's drafts in one forward -> DIR/dflash/
    dspark      a DSpark block drafter (2 layers, block 7: 7 drafts), Markov and confidence heads -> DIR/dspark/
    evaluate    per head, greedy acceptance length on held-out prompts (k = 5, or the MTP head's layers), step timings
The heads are described in training.demo_heads. The loss curves go to DIR/loss_curve.json and .md.

`--only-heads eagle3-mla,mtp` trains only the named heads on the target already in DIR, with its tokenizer: the
tokenizer is read instead of trained, the target stage is skipped, and what DIR's metadata and curves hold of the
target and the other heads is kept (training.records).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from training.data import (
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
from training.demo_heads import DEMO_HEADS, HeadContext, HeadSettings
from training.eagle3 import collect_draft_data
from training.evaluate import measure_acceptance
from training.records import (
    directory_megabytes,
    merge_metadata,
    read_curves,
    read_metadata,
    write_curves,
)
from training.target import (
    LossPoint,
    TargetShape,
    TargetTraining,
    build_target,
    load_llama_target,
    save_target,
    target_summary,
    train_target,
)

LOG = logging.getLogger("training.demo")
TARGET_NOTE = "Next-token cross-entropy (nats) on the training blocks."


@dataclass(frozen=True)
class DemoSettings:
    budget_minutes: float = 60.0
    target_budget_share: float = 0.5  # of the whole budget; the rest goes to the data, the heads and evaluation
    draft_budget_share: float = 0.2  # of the whole budget, for each head
    target_shape: TargetShape = field(default_factory=TargetShape)
    target_training: TargetTraining = field(default_factory=TargetTraining)
    heads: HeadSettings = field(default_factory=HeadSettings)
    num_continuations: int = 1536  # held-in prompts continued by the target for the heads' training data
    continuation_prompt_tokens: int = 64
    continuation_new_tokens: int = 192
    continuation_batch: int = 64
    num_eval_prompts: int = 16
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 128
    held_out_eval_blocks: int = 32
    seed: int = 0

    def scaled(self) -> DemoSettings:
        """Stage budgets from the total; a budget under the default one also shrinks the heads' data set."""
        budget = 60.0 * self.budget_minutes
        share = min(1.0, self.budget_minutes / DemoSettings.budget_minutes)
        head_seconds = budget * self.draft_budget_share
        heads = replace(
            self.heads,
            draft_training=replace(self.heads.draft_training, budget_seconds=head_seconds),
            mtp_training=replace(self.heads.mtp_training, budget_seconds=head_seconds),
            dflash_training=replace(self.heads.dflash_training, budget_seconds=head_seconds),
            dspark_training=replace(self.heads.dspark_training, budget_seconds=head_seconds),
        )
        return replace(
            self,
            target_training=replace(self.target_training, budget_seconds=budget * self.target_budget_share),
            heads=heads,
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


def run_demo(
    out: Path, settings: DemoSettings, heads: Sequence[str] = tuple(DEMO_HEADS), with_target: bool = True
) -> dict[str, Any]:
    """Runs the stages (without `with_target`: on the target in out/target); returns the metadata also written to
    out/metadata.json."""
    torch.manual_seed(settings.seed)
    clock = StageClock({})
    target_dir = out / "target"
    curves: dict[str, list[LossPoint]] = {} if with_target else read_curves(out)
    sections: dict[str, Any] = {}

    with clock.stage("corpus"):
        split = split_corpus(stdlib_root(), HELD_OUT_PACKAGES)
        train_texts = list(read_sources(split.train))
        held_out_texts = list(read_sources(split.held_out))
    with clock.stage("tokenizer"):
        if with_target:
            tokenizer = train_tokenizer(train_texts, settings.target_shape.vocab_size)
        else:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir)
        end_id, pad_id = token_id(tokenizer, END_OF_TEXT), token_id(tokenizer, PAD)
        train_stream = encode_documents(tokenizer, train_texts)
        held_out_stream = encode_documents(tokenizer, held_out_texts)
    sections["held_out_packages"] = list(HELD_OUT_PACKAGES)
    sections["corpus"] = {
        "stdlib": str(split.root),
        "train_files": len(split.train),
        "held_out_files": len(split.held_out),
        "train_tokens": int(train_stream.numel()),
        "held_out_tokens": int(held_out_stream.numel()),
    }
    sections["seeds"] = {"everything": settings.seed, "eval_prompts": settings.seed + 1}

    if with_target:
        with clock.stage("target"):
            curves["target"] = []
            sections["target"] = train_target_stage(
                settings, tokenizer, train_stream, held_out_stream, target_dir, curves["target"].append
            )

    with clock.stage("data"):
        # The heads learn the target as served: the saved (bf16-rounded) weights, read back by the serving loader.
        target = load_llama_target(target_dir)
        layers = target.config.num_layers
        capture = tuple(sorted({index for name in heads for index in DEMO_HEADS[name].capture(settings.heads, layers)}))
        prompts = sample_prompts(
            train_stream, settings.num_continuations, settings.continuation_prompt_tokens, settings.seed, end_id
        )
        data = collect_draft_data(
            target,
            prompts,
            settings.continuation_new_tokens,
            capture,
            settings.continuation_batch,
            settings.heads.draft_training.bf16_autocast,
        )
    target_config: dict[str, Any] = json.loads((target_dir / "config.json").read_text())
    context = HeadContext(
        settings.heads, target, target_config, data, capture, pad_id, settings.continuation_prompt_tokens
    )
    trained = train_heads(context, heads, out, clock, curves)
    del context, data, target

    with clock.stage("evaluate"):
        eval_prompts = sample_prompts(
            held_out_stream, settings.num_eval_prompts, settings.eval_prompt_tokens, settings.seed + 1, end_id
        ).tolist()
        for name in heads:
            num_steps = DEMO_HEADS[name].num_steps(settings.heads)
            report = measure_acceptance(target_dir, out / name, eval_prompts, num_steps, settings.eval_new_tokens)
            trained[name]["acceptance"] = asdict(report)

    command = f"python -m training.demo --out {out} --budget-minutes {settings.budget_minutes:g}"
    if not with_target:
        command += f" --only-heads {','.join(heads)}"
    run = {
        "command": command,
        "trained": (["tokenizer", "target"] if with_target else []) + list(heads),
        "torch_threads": torch.get_num_threads(),
        "settings": asdict(settings),
        "stage_seconds": clock.seconds,
    }
    metadata = merge_metadata(read_metadata(out), run, sections, trained, fresh=with_target)
    shipped = [directory for directory in (target_dir, *(out / name for name in DEMO_HEADS)) if directory.is_dir()]
    metadata["file_megabytes"] = {directory.name: directory_megabytes(directory) for directory in shipped}
    out.mkdir(parents=True, exist_ok=True)
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    notes = {"target": TARGET_NOTE} | {name: head.note(settings.heads) for name, head in DEMO_HEADS.items()}
    write_curves(out, curves, notes)
    return metadata


def train_heads(
    context: HeadContext,
    names: Sequence[str],
    out: Path,
    clock: StageClock,
    curves: dict[str, list[LossPoint]],
) -> dict[str, dict[str, Any]]:
    """Each named head trained on the context, one stage each, into out/<name>; their records by name."""
    trained: dict[str, dict[str, Any]] = {}
    for name in names:
        with clock.stage(name):
            curves[name] = []
            trained[name] = DEMO_HEADS[name].train(context, out / name, curves[name].append)
    return trained


def train_target_stage(
    settings: DemoSettings,
    tokenizer: PreTrainedTokenizerFast,
    train_stream: torch.Tensor,  # [num_tokens]
    held_out_stream: torch.Tensor,  # [num_tokens]
    target_dir: Path,
    on_point: Callable[[LossPoint], None],
) -> dict[str, Any]:
    block = settings.target_training.block_length + 1
    train_blocks = pack_blocks(train_stream, block)
    held_out_blocks = pack_blocks(held_out_stream, block)[: settings.held_out_eval_blocks]
    target_config = settings.target_shape.hf_config(token_id(tokenizer, END_OF_TEXT), token_id(tokenizer, PAD))
    target = build_target(target_config, settings.seed)
    record = train_target(target, train_blocks, held_out_blocks, settings.target_training, on_point)
    save_target(target, target_config, tokenizer, target_dir)
    return target_summary(record, settings.target_training)


def head_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in DEMO_HEADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: heads are a comma-separated subset of {', '.join(DEMO_HEADS)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the demo target and its draft heads from scratch.")
    parser.add_argument("--out", type=Path, required=True, help="output directory (target/, one per head, metadata)")
    parser.add_argument("--budget-minutes", type=float, default=DemoSettings.budget_minutes)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--only-heads",
        type=head_names,
        default=None,
        help=f"train only these heads ({', '.join(DEMO_HEADS)}) on the target already in --out",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    settings = DemoSettings(budget_minutes=args.budget_minutes).scaled()
    if args.only_heads is None:
        metadata = run_demo(args.out, settings)
    else:
        metadata = run_demo(args.out, settings, heads=args.only_heads, with_target=False)
    LOG.info("done: %s", json.dumps(metadata["runs"][-1]["stage_seconds"]))
    for name, head in metadata["heads"].items():
        LOG.info("%s: final loss %s, acceptance %s", name, head["final_loss"], json.dumps(head["acceptance"]))


if __name__ == "__main__":
    main()
