"""What a replica drafts with, whatever its kind: the runner every kind provides (ProposalRunner), a batch's drafts
for as many requests as the KV pool holds, and a draft checkpoint prepared against the target (PreparedDraft, made
by draft_server.formats)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from draft_server.prefixes import Attached, DraftPrefixes
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput
from draft_server.tree_draft import TreeDrafter
from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache
from tandem.models.aux_layers import CaptureSpec
from tandem.models.config import ConfigError
from tandem.sampling.draft_tree import DraftTree
from tandem.settings import KVCacheSettings, TreeShape

LOG = logging.getLogger(__name__)


Proposal = TypeVar("Proposal", list[int], DraftTree, covariant=True)


class ProposalRunner(Protocol[Proposal]):
    """What the draft service drives: DraftRunner, MTPRunner or StandaloneRunner (chains: lists of tokens), or
    draft_server.tree_draft.TreeDrafter (trees). propose_what_fits hands on either as a DraftTree."""

    @property
    def cache(self) -> PagedKVCache: ...
    @property
    def requests(self) -> Mapping[str, object]: ...
    @property
    def prefixes(self) -> DraftPrefixes | None: ...  # its prefix cache, if it keeps one
    def propose(self, inputs: Sequence[ProposeInput]) -> Sequence[Proposal]: ...
    def release(self, request_ids: Sequence[str]) -> None: ...


@dataclass(frozen=True)
class Proposals:
    """A batch's outcome, by request id: drafts; requests dropped (no KV room, or a prefix this replica lacks: each
    must be replayed from scratch before it proposes for it again) and why; (prefix positions asked of its cache,
    found there) (draft_server.prefixes)."""

    drafts: dict[str, DraftTree]
    exhausted: dict[str, str]
    prefix: dict[str, tuple[int, int]] = field(default_factory=dict)


def propose_what_fits(
    runner: ProposalRunner[list[int]] | ProposalRunner[DraftTree], inputs: Sequence[ProposeInput]
) -> Proposals:
    """Proposes for as many requests as the KV pool holds, each from its whole context.

    Requests whose rows skip a prefix take its draft KV from the replica's cache first; one it lacks is dropped.
    The runners refuse a batch before changing anything when it does not fit, so the newest request (the scheduler
    sends them oldest first) is dropped with its state, and the rest is tried again.
    """
    remaining = list(inputs)
    attached = runner.prefixes.attach(remaining) if runner.prefixes is not None else Attached({}, {})
    exhausted = dict(attached.missing)
    runner.release(list(attached.missing))
    remaining = [item for item in remaining if item.request_id not in attached.missing]
    drafts: dict[str, DraftTree] = {}
    while remaining:
        try:
            proposals = runner.propose(remaining)
        except OutOfKVBlocks as error:
            dropped = remaining.pop()
            exhausted[dropped.request_id] = str(error)
            runner.release([dropped.request_id])
            continue
        trees = [as_draft_tree(proposal) for proposal in proposals]
        drafts = {item.request_id: tree for item, tree in zip(remaining, trees, strict=True)}
        break
    return Proposals(drafts, exhausted, attached.prefix)


def ingest_final_rows(
    runner: ProposalRunner[list[int]] | ProposalRunner[DraftTree], inputs: Sequence[ProposeInput]
) -> None:
    """Ingests the last rows of requests about to be released (a one-step proposal, its drafts unused), so that
    their draft blocks are named in the prefix cache; rows that no longer continue a request's state are skipped."""
    try:
        propose_what_fits(runner, inputs)
    except DraftRequestError as error:
        LOG.info("the last rows of %d released requests were not cached: %s", len(inputs), error)


def as_draft_tree(proposal: list[int] | DraftTree) -> DraftTree:
    """A runner's proposal as the one value every edge carries: a chain's token list is the degenerate tree."""
    return proposal if isinstance(proposal, DraftTree) else DraftTree.chain(proposal)


@dataclass(frozen=True)
class PreparedDraft:
    architecture: str  # the checkpoint's
    kind: str  # "eagle3", "nextn", "chained-mtp", "standalone", "dflash", "dflash2", "dspark" or "gemma4-assistant"
    capture: CaptureSpec
    missing_tables: tuple[str, ...]  # shared tables to pull from the target (its GetWeights names)
    fill_table: Callable[[str, torch.Tensor], None]  # (name, [vocab, hidden] table)
    build_runner: Callable[[KVCacheSettings], ProposalRunner]  # once every missing table is filled
    tokens_only: bool = False  # the draft takes committed tokens and no hidden states (capture.indices is empty)
    image_embeddings: bool = False  # takes the target's embedding of an image's tokens (draft_server.image_inputs)

    def build_proposer(self, cache: KVCacheSettings, tree: TreeShape) -> ProposalRunner:
        """The runner the replica drafts with: the draft's own, expanded into trees with tree.topk > 1 (EAGLE3 and
        NextN heads only; another kind is refused naming it)."""
        runner = self.build_runner(cache)
        if tree.topk == 1:
            return runner
        if not isinstance(runner, DraftRunner):
            raise ConfigError(
                f"--speculative-eagle-topk {tree.topk}: tree drafting needs an EAGLE3 or NextN head; "
                f"this draft is {self.kind!r}, which drafts chains (use --speculative-eagle-topk 1)"
            )
        return TreeDrafter(runner, tree.topk, tree.num_draft_tokens)
