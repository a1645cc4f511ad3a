"""`--hybrid-ngram`: a draft replica's answer with the prompt-lookup proposal merged in, as one more DraftBackend.

`HybridDrafter` wraps a replica's backend: it asks the replica as usual, looks up each request's n-gram proposal
(orchestrator/loop/ngram.py, over the tokens the scheduler hands every ProposeTask) and merges it into the replica's
chain or tree as one more branch (`merge_branch`). The scheduler, the wire and the target see an ordinary answer: a
chain, or a tree with parent indices. The replica's answer is kept whole, so a round never accepts less than the replica
alone would (greedy); the branch adds at most k drafts, only where it leaves the replica's tree.

Why whole (docs/drafting.md, "Hybrid drafting"): on the demo pair, a merge bounded by the replica's own size
(the branch first, the replica's nodes in the room left, which for a chain is the better of the two chains by the
lookup's match length) accepted less than the EAGLE3 head alone at every suffix length tried.

Lossless: the target verifies drafts as deterministic proposals (tandem.sampling.verify and tree_verify take every
draft token's q as one-hot), and an n-gram token is one, a function of the request's committed tokens. Greedy output
is the target's own, and sampled output follows the target's distribution, whatever the merge adds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from orchestrator.loop.ngram import lookup
from orchestrator.loop.proposing import drafts_allowed
from orchestrator.peers.backends import BackendError, DraftBackend, FailureKind, ProposedBatch, ProposeTask
from orchestrator.settings import HybridSettings, SchedulerSettings
from tandem.sampling.draft_tree import DraftTree
from tandem.settings import TreeShape


def merge_branch(
    tree: DraftTree,  # the replica's drafts
    branch: Sequence[int],  # the n-gram proposal: a path from the last committed token
) -> DraftTree:
    """The union of the replica's tree and `branch` as a trie: a branch token equal to a node's token under the same
    parent is that node; the first one that is not starts new nodes, appended after the replica's (so every parent's
    index stays below its children's, and the replica's siblings are tried first when sampling). A result shaped as
    a chain is a chain, which the target verifies in its batched path.

    Example: chain [5, 6, 7] and branch [5, 9, 4]: 5 is node 0, 9 is new under it, 4 under 9: tokens [5, 6, 7, 9, 4],
    parents [-1, 0, 1, 0, 3]. The branch [5, 6] adds nothing: the chain [5, 6, 7] stays a chain.
    """
    tokens, parents = list(tree.tokens), list(tree.parents)
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens, strict=True))}
    at = -1  # the deepest node on the branch's path so far; -1 the last committed token
    for token in branch:
        node = child.get((at, token))
        if node is None:
            parents.append(at)
            tokens.append(token)
            node = len(tokens) - 1
            child[(at, token)] = node
        at = node
    return DraftTree(tuple(tokens), tuple(parents))


class HybridDrafter:
    """A DraftBackend that merges the n-gram proposal into another backend's answer (module docstring)."""

    def __init__(self, model: DraftBackend, settings: HybridSettings, tree: TreeShape) -> None:
        self.model = model
        self.settings = settings
        self.tree = tree  # resolved: the shape the replica drafts

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        batch = await self.model.propose(tasks)
        started = time.perf_counter()
        ngram = self.settings.ngram
        drafts = dict(batch.drafts)
        for task in tasks:
            drafted = batch.drafts.get(task.request_id)
            if drafted is None:
                continue  # exhausted on the replica, or missing (the scheduler's check names it)
            # The scheduler's own checks, taken before the branch is added (the merged answer is checked again,
            # with the branch's room).
            fault = drafted.fault(drafts_allowed(drafted, task.num_steps, self.tree.max_drafts))
            if fault:
                raise BackendError(FailureKind.INVALID, f"request {task.request_id}: {fault}")
            drafts[task.request_id] = merge_branch(
                drafted, lookup(task.tokens, task.num_steps, ngram.min_n, ngram.max_n)
            )
        lookups = time.perf_counter() - started
        return replace(batch, drafts=drafts, compute_seconds=batch.compute_seconds + lookups)

    async def release(self, request_ids: Sequence[str]) -> None:
        await self.model.release(request_ids)

    async def probe(self) -> None:
        await self.model.probe()


def with_hybrid(backend: DraftBackend, settings: SchedulerSettings) -> DraftBackend:
    """A replica's backend as the scheduler uses it: itself, or with --hybrid-ngram a HybridDrafter over it."""
    if settings.hybrid is None:
        return backend
    return HybridDrafter(backend, settings.hybrid, settings.tree.resolved(settings.num_steps))
