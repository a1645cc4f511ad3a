"""Settings of `tandem bench`; the CLI takes its defaults from here (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem.settings import TreeShape


@dataclass(frozen=True)
class BenchSettings:
    target_dir: Path
    draft_dir: Path | None  # None with ngram
    # `--draft ngram`: prompt lookup in the orchestrator, no draft model; with `kinds`, the ngram kind's lookup.
    ngram: NgramSettings | None = None
    # `--hybrid-ngram`: prompt lookup merged into the draft model's answers; with `kinds`, the hybrid kind's.
    hybrid: HybridSettings | None = None
    # `--kinds`: draft kinds measured side by side on the draft model (bench/kinds.py), each on a stack of its own;
    # (): the one configuration of the fields above.
    kinds: tuple[str, ...] = ()
    address: str | None = None  # a running stack; None: start one with `tandem serve`
    num_prompts: int = 32
    max_new_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 8)
    num_steps: int = 5
    tree: TreeShape = field(default_factory=TreeShape)  # --speculative-eagle-topk / --speculative-num-draft-tokens
    adaptive_k: bool = SchedulerSettings.adaptive_k  # choose k per batch (orchestrator/speculation.py), in both setups
    draft_ahead: int = SchedulerSettings.draft_ahead  # `tandem serve --draft-ahead` of the started stack
    push_drafts: bool = SchedulerSettings.push_drafts  # `tandem serve --push-drafts` of the started stack
    dtype: str = "float32"  # of target and draft, in both setups
    repeats: int = 1  # runs of each configuration, interleaved across setups and modes; the report takes medians
    draft_replicas: int = 1  # of the split stack started by the benchmark
    target_threads: int = 0  # `tandem serve --target-threads` of that stack (0: its default)
    draft_threads: int = 0  # `tandem serve --draft-threads` of that stack (0: its default)
    colocated: bool = True
    transformers: bool = True  # rows for Hugging Face transformers `generate` on the same target (bench.huggingface)
    prompt_lookup_num_tokens: int = 5  # of the transformers prompt-lookup row
    out_dir: Path = Path("bench/results")  # latest.md, latest.json (a summary of a few KB) and the PNG
    save_requests: Path | None = None  # a JSON of every request of every run (token ids, stats); None: not written
