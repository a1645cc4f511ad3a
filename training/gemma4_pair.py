"""`python -m training.gemma4_pair --out DIR`: a Gemma 4 target trained here, then its drafters on its own outputs.

Stages (`--stages`, in this order): `target` trains and saves DIR/target (training.gemma4_target) on the demo's
corpus with the demo target's tokenizer; `heads` collects the served target's greedy continuations with every
drafter's rows (training.served_data) and trains Gemma 4's assistant (training.assistant), an EAGLE3 head and a
DFlash drafter on them (training.demo_heads), each into DIR/<name>. DIR/metadata.json and DIR/loss_curve.md record
the runs; `tandem bench --target DIR/target --draft DIR/<name>` measures each drafter (docs/drafting.md).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from tandem.models.registry import load_target
from tandem.settings import DEMO_TARGET
from training.assistant import AssistantShape, assistant_capture, build_assistant, save_assistant, train_assistant
from training.data import (
    END_OF_TEXT,
    HELD_OUT_PACKAGES,
    encode_documents,
    pack_blocks,
    read_sources,
    sample_prompts,
    split_corpus,
    stdlib_root,
    token_id,
)
from training.demo import StageClock, train_heads
from training.demo_heads import DEMO_HEADS, HeadContext, HeadSettings, chain_note, record_summary
from training.eagle3 import captured_features
from training.gemma4_target import Gemma4Shape, build_gemma4_target, gemma4_loss, save_gemma4_target
from training.heads import DraftTraining
from training.records import merge_metadata, read_curves, read_metadata, write_curves
from training.served_data import served_continuations
from training.target import LossPoint, OptimiserSettings, TargetTraining, target_summary, train_target

LOG = logging.getLogger("training.gemma4_pair")
STAGES = ("target", "heads")
BESIDE = ("eagle3", "dflash")  # the drafters trained beside the assistant, as the demo trains them


@dataclass(frozen=True)
class PairSettings:
    target_shape: Gemma4Shape = field(default_factory=Gemma4Shape)
    # fp32: bf16 autocast makes transformers' Gemma 4 backward about 30x slower on the CPU.
    target_training: TargetTraining = field(
        default_factory=lambda: TargetTraining(
            optimiser=OptimiserSettings(learning_rate=2e-3, warmup_steps=30), bf16_autocast=False
        )
    )
    held_out_eval_blocks: int = 16
    heads: HeadSettings = field(default_factory=HeadSettings)
    assistant_shape: AssistantShape = field(default_factory=AssistantShape)
    head_training: DraftTraining = field(default_factory=lambda: DraftTraining(batch_size=8, bf16_autocast=False))
    num_continuations: int = 768  # held-in prompts continued by the target for the drafters' data
    continuation_prompt_tokens: int = 64
    continuation_new_tokens: int = 192  # past the window (128): sliding layers drop rows in the data
    continuation_batch: int = 32
    seed: int = 0

    def with_head_budget(self, seconds: float) -> PairSettings:
        """Every drafter trains for `seconds` on the same settings (fp32: bf16 autocast makes the CPU backward of
        these models many times slower)."""
        training = replace(self.head_training, budget_seconds=seconds)
        dflash = replace(self.heads.dflash_training, budget_seconds=seconds, batch_size=8, bf16_autocast=False)
        heads = replace(self.heads, draft_training=training, dflash_training=dflash)
        return replace(self, heads=heads, head_training=training)


@dataclass(frozen=True)
class Corpus:
    tokenizer: PreTrainedTokenizerFast
    train: torch.Tensor  # [num_tokens]
    held_out: torch.Tensor  # [num_tokens]


def read_corpus() -> Corpus:
    """The demo's split of the standard library, in the demo target's tokens."""
    split = split_corpus(stdlib_root(), HELD_OUT_PACKAGES)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(DEMO_TARGET)
    train = encode_documents(tokenizer, list(read_sources(split.train)))
    return Corpus(tokenizer, train, encode_documents(tokenizer, list(read_sources(split.held_out))))


def train_target_stage(
    settings: PairSettings, corpus: Corpus, directory: Path, curve: list[LossPoint]
) -> dict[str, Any]:
    block = settings.target_training.block_length + 1
    held_out = pack_blocks(corpus.held_out, block)[: settings.held_out_eval_blocks]
    pad_id = corpus.tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    config = settings.target_shape.hf_config(len(corpus.tokenizer), token_id(corpus.tokenizer, END_OF_TEXT), pad_id)
    model = build_gemma4_target(config, settings.seed)
    training = settings.target_training
    record = train_target(model, pack_blocks(corpus.train, block), held_out, training, curve.append, gemma4_loss)
    save_gemma4_target(model, corpus.tokenizer, directory)
    return target_summary(record, training)


def train_heads_stage(
    settings: PairSettings, corpus: Corpus, out: Path, clock: StageClock, curves: dict[str, list[LossPoint]]
) -> dict[str, dict[str, Any]]:
    """The served target's continuations with every drafter's rows, then each drafter trained on its columns."""
    target_dir = out / "target"
    target = load_target(target_dir)
    target_config: dict[str, Any] = json.loads((target_dir / "config.json").read_text())
    layers, end_id = target.config.num_layers, token_id(corpus.tokenizer, END_OF_TEXT)
    wanted = assistant_capture(target)
    beside = {index for name in BESIDE for index in DEMO_HEADS[name].capture(settings.heads, layers)}
    capture = tuple(sorted({*wanted, *beside}))
    with clock.stage("data"):
        prompts = sample_prompts(
            corpus.train, settings.num_continuations, settings.continuation_prompt_tokens, settings.seed, end_id
        )
        data = served_continuations(
            target, prompts, settings.continuation_new_tokens, capture, settings.continuation_batch
        )
    pad_id = corpus.tokenizer.pad_token_id
    assert isinstance(pad_id, int)
    context = HeadContext(
        settings.heads, target, target_config, data, capture, pad_id, settings.continuation_prompt_tokens
    )
    trained = train_heads(context, BESIDE, out, clock, curves)
    with clock.stage("assistant"):
        hf_config = settings.assistant_shape.hf_config(target_config, target.kept_kv)
        model = build_assistant(hf_config, target.model.embed_tokens.weight.detach(), settings.seed)
        features = captured_features(data.features, capture, wanted)
        curves["assistant"] = []
        record = train_assistant(
            model, data, features, target.kept_kv, pad_id, settings.head_training, curves["assistant"].append
        )
        save_assistant(model, hf_config, out / "assistant")
        trained["assistant"] = record_summary(record, data) | {"capture_indices": list(wanted)}
    return trained


def run(out: Path, settings: PairSettings, stages: tuple[str, ...]) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    clock = StageClock({})
    curves: dict[str, list[LossPoint]] = {}
    sections: dict[str, Any] = {}
    with clock.stage("corpus"):
        corpus = read_corpus()
    if "target" in stages:
        with clock.stage("target"):
            curves["target"] = []
            sections["target"] = train_target_stage(settings, corpus, out / "target", curves["target"])
    trained = train_heads_stage(settings, corpus, out, clock, curves) if "heads" in stages else {}
    run_record = {
        "command": f"python -m training.gemma4_pair --out {out} --stages {','.join(stages)}",
        "torch_threads": torch.get_num_threads(),
        "settings": asdict(settings),
        "stage_seconds": clock.seconds,
    }
    metadata = merge_metadata(read_metadata(out), run_record, sections, trained, fresh="target" in stages)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    heads = settings.heads
    notes = {"target": "Next-token cross-entropy (nats) on the training blocks."} | {
        name: DEMO_HEADS[name].note(heads) for name in BESIDE
    }
    notes["assistant"] = chain_note(settings.head_training, "steps of a round (one position)")
    write_curves(out, (read_curves(out) if "target" not in stages else {}) | curves, notes)
    return metadata


def stage_names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(name not in STAGES for name in names):
        raise argparse.ArgumentTypeError(f"{text!r}: stages are a comma-separated subset of {', '.join(STAGES)}")
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a Gemma 4 target and its drafters from scratch.")
    parser.add_argument("--out", type=Path, required=True, help="output directory (target/, one per drafter)")
    parser.add_argument("--stages", type=stage_names, default=STAGES, help=f"a subset of {','.join(STAGES)}")
    parser.add_argument("--target-minutes", type=float, default=20.0, help="the target's wall-time budget")
    parser.add_argument("--head-minutes", type=float, default=10.0, help="each drafter's wall-time budget")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    settings = PairSettings()
    settings = replace(
        settings, target_training=replace(settings.target_training, budget_seconds=60.0 * args.target_minutes)
    )
    metadata = run(args.out, settings.with_head_budget(60.0 * args.head_minutes), args.stages)
    LOG.info("done: %s", json.dumps(metadata["runs"][-1]["stage_seconds"]))


if __name__ == "__main__":
    main()
