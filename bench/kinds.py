"""The draft configurations `tandem bench` measures: the one --draft and its flags give, or several named kinds side
by side (`--kinds chain tree ngram hybrid block`), each on a stack and a colocated engine of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.settings import BenchSettings
from launch.model_dirs import block_drafts
from launch.serve_settings import ServeSettings
from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem import flags
from tandem.settings import TreeShape

KIND_NAMES = ("chain", "tree", "ngram", "hybrid", "block")
# The tree kind's shape when the shape flags give a chain: SGLang's default for Llama-class models.
TREE_KIND = TreeShape(topk=4, num_draft_tokens=8)


@dataclass(frozen=True)
class DraftKind:
    name: str  # one of KIND_NAMES, or "" for the one configuration of --draft and its flags
    draft_dir: Path | None  # the draft model; None: none (n-gram drafting in the orchestrator)
    tree: TreeShape  # resolved: the model's drafts (topk 1: chains)
    ngram: NgramSettings | None = None  # n-gram drafting in the orchestrator, instead of a draft model
    hybrid: HybridSettings | None = None  # n-gram drafts merged into the draft model's answers
    num_steps: int | None = None  # draft tokens per round; None: the benchmark's --speculative-num-steps

    def steps(self, settings: BenchSettings) -> int:
        return settings.num_steps if self.num_steps is None else self.num_steps

    def describe(self) -> str:
        """What drafts, in a few words (the report's header)."""
        if self.ngram is not None:
            return f"n-gram drafts (suffixes of {self.ngram.max_n} down to {self.ngram.min_n} tokens)"
        assert self.draft_dir is not None  # a kind has a draft model or n-gram drafting
        shape = "chain" if self.tree.topk == 1 else f"tree of topk {self.tree.topk}, {self.tree.max_drafts} drafts"
        if self.num_steps is not None:
            shape = f"{shape} of {self.num_steps} drafts"
        merged = ""
        if self.hybrid is not None:
            ngram = self.hybrid.ngram
            merged = f" + n-gram branch (suffixes of {ngram.max_n} down to {ngram.min_n} tokens)"
        return f"{self.draft_dir.name} {shape}{merged}"

    def serve_arguments(self, settings: BenchSettings) -> list[str]:
        """`tandem serve`'s draft options for this kind (no draft process for n-gram drafting)."""
        if self.ngram is not None:
            return flags.field_arguments(ServeSettings, ngram=self.ngram)
        assert self.draft_dir is not None
        return [
            "--draft", str(self.draft_dir.absolute()),  # absolute: a directory named ngram is not --draft ngram
            "--draft-replicas", str(settings.draft_replicas),
            "--draft-threads", str(settings.draft_threads),
            *flags.arguments_of(self.tree),
            *flags.field_arguments(SchedulerSettings, hybrid=self.hybrid),
        ]  # fmt: skip


def draft_kinds(settings: BenchSettings) -> list[DraftKind]:
    """The configurations to measure, in the order they run.

    chain: the draft model as a chain of --speculative-num-steps; tree: as a tree of the flags' shape, or of
    TREE_KIND when the flags give a chain; ngram: prompt lookup, no draft model; hybrid: the draft model in
    the flags' shape (a chain unless they say otherwise) with the n-gram branch merged in; block: the block drafter
    of --block-draft, B - 1 drafts a round.
    """
    if not settings.kinds:
        return [DraftKind("", settings.draft_dir, settings.tree, settings.ngram, settings.hybrid)]
    model = settings.draft_dir
    if model is None and any(name not in ("ngram", "block") for name in settings.kinds):
        raise ValueError("--kinds chain, tree and hybrid draft with a model: give --draft DIR or demo:<name>")
    steps = settings.num_steps
    tree = settings.tree if settings.tree.topk > 1 else TREE_KIND.resolved(steps)
    built = {
        "chain": DraftKind("chain", model, TreeShape().resolved(steps)),
        "tree": DraftKind("tree", model, tree),
        "ngram": DraftKind("ngram", None, TreeShape().resolved(steps), ngram=settings.ngram or NgramSettings()),
        "hybrid": DraftKind("hybrid", model, settings.tree, hybrid=settings.hybrid or HybridSettings()),
    }
    return [built[name] if name != "block" else block_kind(settings.block_draft) for name in settings.kinds]


def block_kind(directory: Path) -> DraftKind:
    """The block drafter's kind: chains of its whole block, B - 1 drafts (read from its config.json)."""
    steps = block_drafts(directory)
    if steps is None:
        raise ValueError(f"--block-draft {directory}: not a block drafter (a DFlash checkpoint's config.json)")
    return DraftKind("block", directory, TreeShape().resolved(steps), num_steps=steps)
