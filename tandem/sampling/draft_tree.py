"""A round's drafts as one value, with their rules in one place (no torch: every process and the wire use it).

A draft tree is `tokens` (target vocabulary ids) with `parents`: for node i, the index of its parent among the
nodes, or -1 for a child of the last committed token (the root). Parents always point to earlier nodes, so the nodes
are in an order where a parent comes before its children. A chain of k drafts is the tree whose parents are
[-1, 0, ..., k - 2]: every node the only child of the one before. On the wire a chain carries no parents
(tandem.wire.drafts), which is the common case.

A drafter that scores its drafts (DSpark's confidence head) gives `scores`, one per node: its chance that the node
is accepted given that its path to it was (prefix survival of a chain: s_0 * ... * s_j); none otherwise.

Worked example: tokens [5, 6, 7, 8, 9], parents [-1, -1, 0, 1, 1]: the root's children are nodes 0 and 1, node 0's
child is 2, node 1's are 3 and 4; depths [1, 1, 2, 2, 2], so a round can add at most 2 drafts (plus the target's
correction or bonus token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()  # one per token: -1 (the root) or an earlier node's index
    scores: tuple[float, ...] = ()  # one per token, or none (module docstring)

    @classmethod
    def chain(cls, tokens: Sequence[int], scores: Sequence[float] = ()) -> DraftTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), tuple(scores))

    @classmethod
    def of(cls, tokens: Sequence[int], parents: Sequence[int] = (), scores: Sequence[float] = ()) -> DraftTree:
        """A tree from tokens, parents and scores as the wire carries them: no parents for a chain. Call `fault`
        before trusting what another process sent."""
        return cls(tuple(tokens), tuple(parents), tuple(scores)) if parents else cls.chain(tokens, scores)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    def wire_parents(self) -> tuple[int, ...]:
        """The parents as the wire carries them: none for a chain."""
        return () if self.is_chain else self.parents

    def depths(self) -> list[int]:
        """Each node's depth: 1 for a child of the root (a checked tree)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def depth(self) -> int:
        """How many drafts a round can accept at most: a chain's length, a tree's depth."""
        return max(self.depths(), default=0)

    def paths(self) -> list[tuple[int, ...]]:
        """The tokens before each scored row's choice: () for the root's row, then node i's path from the root down
        to it, itself included (its row decides the token after it)."""
        paths: list[tuple[int, ...]] = [()]
        for token, parent in zip(self.tokens, self.parents, strict=True):
            paths.append((*paths[parent + 1], token))
        return paths

    def matched(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (committed after the root) run along a path of the tree: the accepted drafts that
        were the drafter's. A constrained request may accept more, tokens its grammar forced in
        (tandem.sampling.grammar.GrammarState.shaped). Example: chain [5, 6, 7], tokens [5, 6, 9] -> 2."""
        return max((len(path) for path in self.paths() if tuple(tokens[: len(path)]) == path), default=0)

    def children(self) -> list[list[int]]:
        """children[0] are the root's children, children[1 + i] node i's, each in index order."""
        children: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for node, parent in enumerate(self.parents):
            children[parent + 1].append(node)
        return children

    def first(self, count: int) -> DraftTree:
        """The first `count` nodes (a chain's first drafts; a tree's first nodes keep their parents and scores)."""
        return DraftTree(self.tokens[:count], self.parents[:count], self.scores[:count])

    def fault(self, max_tokens: int, vocab_size: int | None = None) -> str:
        """What is wrong with drafts another process sent ("" if nothing): more than `max_tokens`, parents that do
        not make a tree, scores that are not one probability per node, or (when `vocab_size` is given) ids outside
        the vocabulary."""
        if len(self.tokens) > max_tokens:
            return f"draft_tokens: {len(self.tokens)}, at most {max_tokens}"
        fault = parents_fault(self.parents, len(self.tokens))
        if fault:
            return fault
        if self.scores and len(self.scores) != len(self.tokens):
            return f"scores: {len(self.scores)} entries for {len(self.tokens)} nodes"
        for index, score in enumerate(self.scores):
            if not 0.0 <= score <= 1.0:  # NaN fails too
                return f"scores[{index}]: {score} is not a probability"
        for index, token in enumerate(self.tokens):
            if vocab_size is not None and not 0 <= token < vocab_size:
                return f"draft_tokens[{index}]: {token} is outside the vocabulary [0, {vocab_size})"
        return ""


def parents_fault(parents: Sequence[int], count: int, name: str = "parents") -> str:
    """What is wrong with parents for `count` nodes ("" if nothing): one per node, each -1 or an earlier index."""
    if len(parents) != count:
        return f"{name}: {len(parents)} entries for {count} nodes"
    for index, parent in enumerate(parents):
        if not -1 <= parent < index:
            return f"{name}[{index}]: {parent} must be -1 (the root) or an earlier index (0..{index - 1})"
    return ""


def check_parents(parents: Sequence[int], count: int, name: str = "parents") -> None:
    """Raises ValueError with parents_fault's message unless the parents make a tree of `count` nodes."""
    fault = parents_fault(parents, count, name)
    if fault:
        raise ValueError(fault)
