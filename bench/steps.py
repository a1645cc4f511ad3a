"""`python -m bench.steps`: the model steps of a round, in one process on the CPU, with and without the weight copies.

The split benchmark (`tandem bench`) times whole rounds through the services; this one times what the runners
compute, so that a change to the model code can be measured without the hops around it. For every batch size of
`--concurrency` it times, on the demo pair (or `--target` and an EAGLE3 `--draft`):
    verify   one TargetRunner step in which every request verifies `--drafts` draft tokens;
    decode   one TargetRunner step decoding one token per request;
    propose  one DraftRunner proposal of `--drafts` tokens per request after ingesting 4 rows each (random
             features: the head's compute does not depend on them);
each with oneDNN's blocked weight copies (`prepacked`, what the runners use: tandem.layers.matmul.prepack) and
without them (`plain`), the two alternating trial by trial; each trial's time is the median of `--rounds` calls, the
result the median of `--trials` trials. Results go to --out as JSON and Markdown; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers import matmul
from tandem.models.eagle3 import Eagle3Draft, load_eagle3
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import DEMO_DRAFT, DEMO_TARGET, KVCacheSettings
from target_server.items import OpenRequest, StepItem
from target_server.runner import TargetRunner

VARIANTS = ("prepacked", "plain")
PHASES = ("verify", "decode", "propose")
PROMPT_TOKENS = 64
INGEST_ROWS = 4


class WeightCopies:
    """Sets or drops the oneDNN copies of every Linear of the given models (made once, by the runners)."""

    def __init__(self, *models: matmul.Modules) -> None:
        self.copies = {
            module: module.prepacked
            for model in models
            for module in model.modules()
            if isinstance(module, matmul.Linear) and module.prepacked is not None
        }

    def use(self, variant: str) -> None:
        for module, copy in self.copies.items():
            module.prepacked = copy if variant == "prepacked" else None


def median_ms(call: Callable[[], object], rounds: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


def time_phases(
    target: TargetRunner, draft: DraftRunner, feature_width: int, batch: int, drafts: int, rounds: int, tag: str
) -> dict[str, float]:
    """Milliseconds of each phase for `batch` fresh requests (opened here, released after)."""
    ids = [f"{tag}-{index}" for index in range(batch)]
    prompt = list(range(3, 3 + PROMPT_TOKENS))
    target.step([StepItem(i, PROMPT_TOKENS, open=OpenRequest(prompt, SamplingParams())) for i in ids])
    verify = median_ms(lambda: target.step([StepItem(i, 1, DraftTree.chain([9] * drafts)) for i in ids]), rounds)
    decode = median_ms(lambda: target.step([StepItem(i, 1) for i in ids]), rounds)
    target.release(ids)
    generator = torch.Generator().manual_seed(batch)
    context = TargetRows(0, prompt, torch.randn(PROMPT_TOKENS, feature_width, generator=generator))
    draft.propose([ProposeInput(i, context, drafts) for i in ids])
    rows = TargetRows(
        PROMPT_TOKENS, list(range(7, 7 + INGEST_ROWS)), torch.randn(INGEST_ROWS, feature_width, generator=generator)
    )
    propose = median_ms(lambda: draft.propose([ProposeInput(i, rows, drafts) for i in ids]), rounds)
    draft.release(ids)
    return {"verify": verify, "decode": decode, "propose": propose}


def load_draft(draft_dir: Path) -> Eagle3Draft:
    model, has_embedding = load_eagle3(draft_dir)
    if not has_embedding:
        raise SystemExit(f"bench.steps: {draft_dir} has no embedding; give an EAGLE3 head that carries its own")
    return model


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__)
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT, help="an EAGLE3 head with its own embedding")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--drafts", type=int, default=5, help="draft tokens verified and proposed per request")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10, help="calls timed per trial")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: PyTorch's default")
    parser.add_argument("--out", type=Path, default=Path("bench/results/steps"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_model = load_target(args.target)
    draft_model = load_draft(args.draft)
    blocks = max(args.concurrency) * (-(-(PROMPT_TOKENS + 4 * args.drafts * (args.rounds + 2)) // 16) + 1)
    cache = KVCacheSettings(num_blocks=blocks, block_size=16)
    target = TargetRunner(target_model, cache, max_context=target_model.config.max_position_embeddings)
    draft = DraftRunner(draft_model, cache)
    copies = WeightCopies(target_model, draft_model)
    feature_width = draft_model.fc.in_features
    trials: dict[str, dict[str, dict[int, list[float]]]] = {
        variant: {phase: {batch: [] for batch in args.concurrency} for phase in PHASES} for variant in VARIANTS
    }
    for trial in range(args.trials):
        order = VARIANTS if trial % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            copies.use(variant)
            for batch in args.concurrency:
                timed = time_phases(target, draft, feature_width, batch, args.drafts, args.rounds, f"{variant}{trial}")
                for phase, ms in timed.items():
                    trials[variant][phase][batch].append(ms)
        print(f"bench.steps: trial {trial + 1}/{args.trials} done", file=sys.stderr, flush=True)
    copies.use("prepacked")
    summary = report(args, trials, len(copies.copies))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(summary, indent=1))
    (args.out / "latest.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


def report(
    args: argparse.Namespace, trials: dict[str, dict[str, dict[int, list[float]]]], copies: int
) -> dict[str, Any]:
    rows = [
        {
            "phase": phase,
            "concurrency": batch,
            **{f"{variant}_ms": round(statistics.median(trials[variant][phase][batch]), 3) for variant in VARIANTS},
            **{f"{variant}_trials_ms": [round(ms, 3) for ms in trials[variant][phase][batch]] for variant in VARIANTS},
        }
        for phase in PHASES
        for batch in args.concurrency
    ]
    return {
        "target": str(args.target),
        "draft": str(args.draft),
        "drafts": args.drafts,
        "trials": args.trials,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "linears_with_copies": copies,
        "machine": f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}",
        "rows": rows,
    }


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"In one process, {summary['torch_threads']} torch threads, {summary['drafts']} drafts; median of "
        f"{summary['trials']} alternating trials (each the median of {summary['rounds']} calls), ms.",
        "",
        "| phase | concurrency | with weight copies | plain weights | plain / copies |",
        "|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        ratio = row["plain_ms"] / row["prepacked_ms"] if row["prepacked_ms"] > 0 else float("nan")
        cells = [
            row["phase"],
            row["concurrency"],
            f"{row['prepacked_ms']:.2f}",
            f"{row['plain_ms']:.2f}",
            f"{ratio:.2f}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
