"""Settings of `tandem bench`; its options are their fields' (tandem.flags, bench.cli; no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launch.model_dirs import draft_dir_option
from orchestrator.settings import (
    HttpSettings,
    HybridSettings,
    NgramSettings,
    OrchestratorSettings,
    SchedulerSettings,
    check_ngram_kinds,
)
from tandem.devices import DTYPES
from tandem.flags import flag, flag_of, nested, non_negative, positive, thread_count
from tandem.settings import DEMO_DIR, TreeShape

WORKLOADS = ("held-out", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class PrefixWorkload:
    """The prefix-caching workloads of `tandem bench --workload` (bench/prefix_workloads.py)."""

    workload: str = field(
        default="held-out",
        metadata=flag(
            "--workload",
            "held-out: held-out prompts against target-only, colocated and transformers; shared-prefix, multi-turn: "
            "the prefix caches on and off, with and without speculation",
            choices=WORKLOADS,
        ),
    )
    prefix_len: int = field(
        default=1024,
        metadata=flag(
            "--prefix-len", "tokens of each shared prefix, or of a conversation's first turn", parse=positive
        ),
    )
    suffix_len: int = field(default=64, metadata=flag("--suffix-len", "tokens after the prefix", parse=positive))
    num_prefixes: int = field(default=4, metadata=flag("--num-prefixes", "distinct shared prefixes", parse=positive))
    requests_per_prefix: int = field(
        default=4, metadata=flag("--requests-per-prefix", "requests sharing each prefix", parse=positive)
    )
    conversations: int = field(default=4, metadata=flag("--conversations", "chats at once", parse=positive))
    turns: int = field(default=8, metadata=flag("--turns", "turns of each chat", parse=positive))
    user_len: int = field(default=32, metadata=flag("--user-len", "tokens of each later user message", parse=positive))


@dataclass(frozen=True)
class BenchSettings:
    target_dir: Path
    draft_dir: Path | None  # None with ngram
    # `--draft ngram`: prompt lookup in the orchestrator, no draft model; with `kinds`, the ngram kind's lookup.
    ngram: NgramSettings | None = field(default=None, metadata=flag_of(OrchestratorSettings, "ngram"))
    # `--hybrid-ngram`: prompt lookup merged into the draft model's answers; with `kinds`, the hybrid kind's.
    hybrid: HybridSettings | None = field(default=None, metadata=flag_of(SchedulerSettings, "hybrid"))
    # `--kinds`: draft kinds measured side by side on the draft model (bench/kinds.py), each on a stack of its own;
    # (): the one configuration of the fields above. The command's option: its choices are bench.kinds's.
    kinds: tuple[str, ...] = ()
    # The block kind's draft (a DFlash or DSpark directory, or demo:<name>), drafting its whole block a round.
    block_draft: Path = field(
        default=DEMO_DIR / "dflash",
        metadata=flag(
            "--block-draft",
            "the block drafter of --kinds block: a directory, or demo:dflash or demo:dspark",
            parse=draft_dir_option,
        ),
    )
    # A running stack; None: start one with `tandem serve`.
    address: str | None = field(
        default=None, metadata=flag("--address", "a running stack to measure (default: start one)")
    )
    num_prompts: int = field(default=32, metadata=flag("--num-prompts", "held-out prompts per run"))
    prefix: PrefixWorkload = field(default_factory=PrefixWorkload, metadata=nested())
    max_new_tokens: int = field(default=64, metadata=flag("--max-new-tokens", "tokens each prompt generates"))
    concurrency: tuple[int, ...] = field(
        default=(1, 8), metadata=flag("--concurrency", "requests in flight at once; one run per value", count="+")
    )
    # `--structured`: every configuration also runs with a JSON schema on each request (bench/structured.py).
    structured: bool = field(
        default=False,
        metadata=flag(
            "--structured",
            "ask each prompt for JSON and run every configuration free and constrained by the prompt's JSON schema",
        ),
    )
    num_steps: int = field(default=SchedulerSettings.num_steps, metadata=flag_of(SchedulerSettings, "num_steps"))
    tree: TreeShape = field(default_factory=TreeShape, metadata=nested())  # resolved against num_steps on construction
    # Choose k per batch (orchestrator/loop/speculation.py), in both setups.
    adaptive_k: bool = field(
        default=SchedulerSettings.adaptive_k,
        metadata=flag("--adaptive-k", "as on tandem serve; --no-adaptive-k measures a fixed k (both setups)"),
    )
    # `tandem serve --draft-ahead` of the started stack.
    draft_ahead: int = field(
        default=SchedulerSettings.draft_ahead,
        metadata=flag(
            "--draft-ahead",
            "as on tandem serve, for the started stack (the colocated engine has nothing to overlap)",
            parse=non_negative,
            metavar="N",
        ),
    )
    dtype: str = field(default="float32", metadata=flag("--dtype", "of target and draft", choices=DTYPES))
    # Runs of each configuration, interleaved across setups and modes; the report takes medians.
    repeats: int = field(default=1, metadata=flag("--repeats", "runs of each configuration; medians are reported"))
    draft_replicas: int = field(
        default=1, metadata=flag("--draft-replicas", "draft replicas of the split stack the benchmark starts")
    )
    # `tandem serve --target-threads` of that stack (0: its default).
    target_threads: int = field(
        default=0,
        metadata=flag(
            "--target-threads",
            "intra-op (OpenMP) threads of the target (started stack, colocated, transformers); 0: their default",
            parse=thread_count,
        ),
    )
    # `tandem serve --draft-threads` of that stack (0: its default).
    draft_threads: int = field(
        default=0,
        metadata=flag(
            "--draft-threads",
            "intra-op (OpenMP) threads of the started stack's draft; 0: tandem serve's default",
            parse=thread_count,
        ),
    )
    colocated: bool = field(
        default=True, metadata=flag("--colocated", "the one-process baseline (--no-colocated skips it)")
    )
    # Rows for Hugging Face transformers `generate` on the same target (bench.huggingface).
    transformers: bool = field(
        default=True,
        metadata=flag(
            "--transformers",
            "the Hugging Face transformers rows, greedy and prompt lookup (--no-transformers skips them)",
        ),
    )
    prompt_lookup_num_tokens: int = 5  # of the transformers prompt-lookup row
    # latest.md, latest.json (a summary of a few KB) and the PNG.
    out_dir: Path = field(
        default=Path("bench/results"), metadata=flag("--out", "the directory of latest.md, latest.json and the plot")
    )
    # A JSON of every request of every run (token ids, stats); None: not written.
    save_requests: Path | None = field(
        default=None,
        metadata=flag(
            "--save-requests", "also write every request's tokens and statistics to this JSON file", parse=Path
        ),
    )

    def __post_init__(self) -> None:
        # The tree shape is checked against num_steps, and N filled in, once: ValueError names the flags.
        object.__setattr__(self, "tree", self.tree.resolved(self.num_steps))
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        if not self.kinds:  # the kinds hold the lookups of the ngram and hybrid kinds side by side
            check_ngram_kinds(self.ngram, self.hybrid)
            if self.ngram is not None and self.draft_replicas != BenchSettings.draft_replicas:
                raise ValueError("--draft ngram drafts in the orchestrator and starts no --draft-replicas")


@dataclass(frozen=True)
class ProfileSettings:
    """Settings of `tandem bench-profile` (bench/profile.py); its options are these fields' and --target, --draft."""

    target_dir: Path
    draft_dir: Path
    num_prompts: int = field(default=16, metadata=flag("--num-prompts", "held-out prompts per run", parse=positive))
    max_new_tokens: int = field(
        default=64, metadata=flag("--max-new-tokens", "tokens each prompt generates", parse=positive)
    )
    rate: int = field(default=250, metadata=flag("--rate", "py-spy samples per second and thread", parse=positive))
    out: Path = field(default=Path("bench/results/profile"), metadata=flag("--out", "where the report goes"))


@dataclass(frozen=True)
class MixedSettings:
    """Settings of `tandem bench-mixed` (bench/mixed.py); its options are these fields' and --target, --draft."""

    target_dir: Path
    draft_dir: Path
    num_prompts: int = field(
        default=24, metadata=flag("--num-prompts", "requests in the stream, classes interleaved", parse=positive)
    )
    max_new_tokens: int = field(
        default=64, metadata=flag("--max-new-tokens", "max_tokens of each request", parse=positive)
    )
    concurrency: tuple[int, ...] = field(
        default=(1, 4), metadata=flag("--concurrency", "requests in flight at once; one stream per value", count="+")
    )
    repeats: int = field(
        default=3, metadata=flag("--repeats", "speculative and target-only streams at each concurrency", parse=positive)
    )
    chat_template: Path | None = field(default=None, metadata=flag_of(HttpSettings, "chat_template"))
    out: Path = field(default=Path("bench/results/mixed"), metadata=flag("--out", "where the report goes"))
