"""Tree drafting for EAGLE3 heads (EAGLE-2/3's dynamic tree): expand the top-K frontier by cumulative score, keep the
best N - 1 nodes.

Scores are cumulative log probabilities of the draft (the log of parent_score * p). Step 0 takes the top K tokens of
the draft's distribution after the ingested rows; each later step runs the frontier's K nodes, scores their top-K
children (K * K candidates, parent score + log p) and keeps the best K as the next frontier; `num_steps` steps in
all. Of every node created, the best `num_draft_tokens - 1` by score form the tree. A child's score never exceeds its
parent's (log p <= 0) and ties rank the earlier-created node first, so the selection always holds a node's parent.

Worked example, K 2, steps 2, N - 1 = 3: step 0 gives a (-0.1), b (-0.5); step 1 runs a and b, whose children
a1 (-0.3), a2 (-2.0), b1 (-0.9), b2 (-0.7) leave the frontier a1, b2. Nodes by score: a, a1, b, b2, so the tree is
[a, b, a1] with parents [-1, -1, 0] (nodes in creation order, so a parent's index is below its child's).

The draft KV of the expansion is speculative, as the chain's: the next ingest truncates it. A step runs every node
created so far that has been expanded, as one tree of new tokens after the ingested rows (the page table's tree mask:
each node sees the context and its ancestors only), so that no node attends to another branch; the rows are
rewritten from the ingest's end at each step, which costs at most K * (steps - 1) rows a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from draft_server.prefixes import DraftPrefixes
from draft_server.runner import DraftModel, DraftRequest, DraftRunner, ProposeInput
from tandem.layers.kv_cache import PagedKVCache
from tandem.sampling.draft_tree import DraftTree


@dataclass
class _Node:
    token: int  # target vocabulary id
    parent: int  # index among the request's nodes, -1: the last committed token
    score: float  # cumulative log probability
    input_hidden: torch.Tensor  # [hidden] the hidden state its row takes: its parent's output


@dataclass
class _Expansion:
    """One request's nodes in creation order, and which of them form the current frontier."""

    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)  # nodes that have run, in creation order

    def grow(self, node: _Node) -> None:
        """Adds a node to the request's nodes and to the frontier."""
        self.frontier.append(len(self.nodes))
        self.nodes.append(node)

    def path(self, node: int) -> list[int]:
        """The tokens from the root down to `node`, itself included."""
        tokens = []
        while node >= 0:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]


def select_tree(scores: Sequence[float], parents: Sequence[int], count: int) -> list[int]:
    """The `count` best nodes by score (ties: earlier first), in creation order; raises if the choice would drop a
    kept node's parent, which the scoring rule of the module docstring rules out."""
    ranked = sorted(range(len(scores)), key=lambda node: (-scores[node], node))
    kept = sorted(ranked[:count])
    chosen = set(kept)
    for node in kept:
        if parents[node] >= 0 and parents[node] not in chosen:
            raise ValueError(f"tree selection: node {node} kept without its parent {parents[node]}")
    return kept


def best_children(
    parent_scores: Sequence[float],  # [K] the frontier's cumulative scores
    child_log_probs: Sequence[Sequence[float]],  # [K, K] each frontier node's top-K log probabilities
    child_tokens: Sequence[Sequence[int]],  # [K, K] their tokens
    topk: int,
) -> list[tuple[float, int, int]]:  # -> the next frontier: (score, parent's slot in the frontier, token)
    """The best `topk` of the K * K children by parent score + log p; ties keep the frontier's order."""
    candidates = [
        (score + log_prob, slot, int(token))
        for slot, score in enumerate(parent_scores)
        for log_prob, token in zip(child_log_probs[slot], child_tokens[slot], strict=True)
    ]
    return sorted(candidates, key=lambda candidate: -candidate[0])[:topk]


def as_tree(nodes: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The parents of `nodes` (increasing, closed under parents) renumbered among themselves."""
    index = {node: position for position, node in enumerate(nodes)}
    return [-1 if parents[node] < 0 else index[parents[node]] for node in nodes]


@torch.inference_mode()
def propose_trees(
    runner: DraftRunner, inputs: Sequence[ProposeInput], topk: int, num_draft_tokens: int
) -> list[DraftTree]:
    """Ingests each request's rows, then expands a tree of depth item.num_steps for each (module docstring).

    Under inference mode, as every runner's forward: outside it the KV cache's in-place writes would join autograd's
    graph, and every step of every request since start-up would stay in memory through the cache (about 85 MB a
    round at 32 requests on the demo head, until the process ran out of memory)."""
    if topk < 1 or num_draft_tokens < 2:
        raise ValueError(f"topk {topk} must be >= 1 and num_draft_tokens {num_draft_tokens} >= 2")
    runner.check_rows(inputs)
    # The largest expansion step rewrites the ingest's end onwards: K rows per step after the first at most.
    runner.check_blocks(inputs, rows_per_step=topk)
    requests, hidden, logits = runner.ingest(inputs)  # hidden [b, hidden], logits [b, draft vocab]
    logits = runner.shaped(logits, [item.shaping for item in inputs], [[] for _ in inputs])
    expansions = _first_frontiers(runner.model, hidden, logits, topk)
    for step_index in range(1, max(item.num_steps for item in inputs)):
        active = [i for i, item in enumerate(inputs) if item.num_steps > step_index]
        if not active:
            break
        active_expansions = [expansions[i] for i in active]
        active_inputs, active_requests = [inputs[i] for i in active], [requests[i] for i in active]
        children = _run_expanded(runner, active_inputs, active_requests, active_expansions, topk)
        _advance_frontiers(active_expansions, children, topk)
    return [_selected_tree(expansion, num_draft_tokens) for expansion in expansions]


@dataclass(frozen=True)
class _Children:
    """What one expansion step's forward gives the frontier's rows, K rows per active request in their order."""

    hidden: torch.Tensor  # [active * K, hidden] each frontier node's output, the input of its children's rows
    log_probs: list[list[float]]  # [active * K, K] each frontier node's top-K log probabilities
    tokens: list[list[int]]  # [active * K, K] their tokens, target vocabulary


def _first_frontiers(
    model: DraftModel,
    hidden: torch.Tensor,  # [b, hidden] each request's last ingested row's output
    logits: torch.Tensor,  # [b, draft vocab] its draft logits
    topk: int,
) -> list[_Expansion]:
    """Step 0: per request, the K best tokens after its ingested rows, children of the last committed token."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [b, draft vocab]
    best, best_ids = log_probs.topk(topk, dim=-1)  # [b, K]
    targets = model.to_target_ids(best_ids.flatten()).view_as(best_ids)  # [b, K]
    expansions = [_Expansion() for _ in range(best.shape[0])]
    for row, expansion in enumerate(expansions):
        for score, token in zip(best[row].tolist(), targets[row].tolist(), strict=True):
            expansion.grow(_Node(int(token), -1, float(score), hidden[row]))
    return expansions


def _run_expanded(
    runner: DraftRunner,
    inputs: Sequence[ProposeInput],  # the active requests'
    requests: Sequence[DraftRequest],
    expansions: Sequence[_Expansion],
    topk: int,
) -> _Children:
    """One packed forward of every active request's expanded nodes (the frontier now among them), each request's as
    one tree after its ingested rows; the draft KV they wrote last step is rewritten."""
    model, cache = runner.model, runner.cache
    sequences, trees, tokens, hiddens = [], [], [], []
    for item, request, expansion in zip(inputs, requests, expansions, strict=True):
        expansion.expanded += expansion.frontier
        cache.truncate(request.kv, item.rows.start_position + len(item.rows.next_tokens))
        run = expansion.expanded
        sequences.append((request.kv, len(run)))
        trees.append(as_tree(run, [node.parent for node in expansion.nodes]))
        tokens += [expansion.nodes[node].token for node in run]
        hiddens += [expansion.nodes[node].input_hidden for node in run]
    metadata = cache.plan(sequences, parents=trees)
    slices = metadata.page_table.query_slices()
    # Only the frontier's rows draft: they are each sequence's last K rows (the frontier was created last).
    frontier_rows = [row for rows in slices for row in range(rows.stop - topk, rows.stop)]
    selector = torch.tensor(frontier_rows, dtype=torch.long, device=cache.device)
    input_ids = torch.tensor(tokens, dtype=torch.long, device=cache.device)  # target vocabulary ids
    step = model(input_ids, torch.stack(hiddens), metadata, cache, selector)
    shapings = [item.shaping for item in inputs for _ in range(topk)]
    paths = [expansion.path(node) for expansion in expansions for node in expansion.frontier] if any(shapings) else []
    logits = runner.shaped(step.logits, shapings, paths)  # [a * K, draft vocab]
    child_log_probs, child_ids = torch.log_softmax(logits.float(), dim=-1).topk(topk, dim=-1)  # [a * K, K]
    child_targets = model.to_target_ids(child_ids.flatten()).view_as(child_ids).tolist()
    return _Children(step.hidden[selector], child_log_probs.tolist(), child_targets)


def _advance_frontiers(expansions: Sequence[_Expansion], children: _Children, topk: int) -> None:
    """Replaces each active request's frontier by the best K of its frontier's K * K children."""
    for position, expansion in enumerate(expansions):
        rows = slice(position * topk, (position + 1) * topk)
        parent_scores = [expansion.nodes[parent].score for parent in expansion.frontier]
        best = best_children(parent_scores, children.log_probs[rows], children.tokens[rows], topk)
        frontier = expansion.frontier
        expansion.frontier = []
        for score, slot, token in best:
            expansion.grow(_Node(token, frontier[slot], score, children.hidden[rows.start + slot]))


def _selected_tree(expansion: _Expansion, num_draft_tokens: int) -> DraftTree:
    """The best num_draft_tokens - 1 of the request's nodes, as a tree."""
    parents = [node.parent for node in expansion.nodes]
    kept = select_tree([node.score for node in expansion.nodes], parents, num_draft_tokens - 1)
    return DraftTree(tuple(expansion.nodes[node].token for node in kept), tuple(as_tree(kept, parents)))


class TreeDrafter:
    """A DraftRunner that proposes trees of the given shape (draft_server.formats.ProposalRunner of DraftTree)."""

    def __init__(self, runner: DraftRunner, topk: int, num_draft_tokens: int) -> None:
        self.runner = runner
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens

    @property
    def cache(self) -> PagedKVCache:
        return self.runner.cache

    @property
    def requests(self) -> Mapping[str, object]:
        return self.runner.requests

    @property
    def prefixes(self) -> DraftPrefixes | None:
        return self.runner.prefixes

    def propose(self, inputs: Sequence[ProposeInput]) -> list[DraftTree]:
        return propose_trees(self.runner, inputs, self.topk, self.num_draft_tokens)

    def release(self, request_ids: Sequence[str]) -> None:
        self.runner.release(request_ids)
