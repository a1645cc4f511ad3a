"""Drafts that replicas push to the target (PushDrafts), held until the step that verifies them.

A replica that drafted a request's next round ahead (HiddenStates.draft_ahead with push) writes the drafts to the
target on a stream of its own instead of waiting for the orchestrator's Propose. The orchestrator still decides every
step; its item for the request's next round says "the drafts your replica pushed, at most k" (StepItem.pushed_drafts)
instead of carrying them, and the target waits for them here, up to the step's `pushed_wait_seconds`. What comes
checks out or is not used: a push with ids outside the vocabulary or a malformed tree is verified as no drafts and
reported against the replica, as the orchestrator does with a bad Propose.

Drafts are kept per (request id, round of the rows they came from) and only from the replica the request's rows go
to; taking a round drops the request's older ones, and releasing a request drops all of its.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from tandem.grpc_util import CallFailed
from tandem.layers.page_table import check_tree
from tandem.wire import target_pb2

Key = tuple[str, int]  # (request id, round of the rows they were drafted from)


@dataclass(frozen=True)
class Pushed:
    """One request's pushed drafts as the step uses them: tokens and parents (a tree; () for a chain), or the
    reason there are none (`error`); `compute_seconds` is the replica's batch that made them."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    error: CallFailed | None = None
    compute_seconds: float = 0.0


class PushedDrafts:
    """Drafts pushed by replicas, keyed by (request id, round). `accepts(replica, request id)` says whether a push
    may be kept: the request runs and its rows go to that replica."""

    def __init__(self, accepts: Callable[[str, str], bool]) -> None:
        self._accepts = accepts
        self._held: dict[Key, tuple[target_pb2.PushedDrafts, float]] = {}  # with the batch's compute seconds
        self._changed = asyncio.Event()  # set when drafts arrive or a replica leaves
        self.dropped = 0  # pushes not kept (a request released, moved or unknown), for tests and logs

    def __len__(self) -> int:
        return len(self._held)

    def add(self, batch: target_pb2.PushedBatch) -> None:
        for drafts in batch.drafts:
            if not self._accepts(batch.replica_id, drafts.request_id):
                self.dropped += 1
                continue
            self._held[(drafts.request_id, drafts.round)] = (drafts, batch.compute_seconds)
        self._changed.set()

    def replica_left(self) -> None:
        """Wakes steps waiting for drafts: those of a replica whose streams ended will not come."""
        self._changed.set()

    async def take(
        self, wanted: dict[Key, tuple[int, int]], wait_s: float, vocab_size: int, can_come: Callable[[str], bool]
    ) -> dict[Key, Pushed]:
        """The drafts of every wanted key (key -> at most how many, at most how deep; 0: any depth), waiting up
        to `wait_s` for those not here yet that can still come (`can_come(request id)`: its replica is still
        connected); each key gets its drafts, cut to its limits and checked, or the reason it has none. They are
        held until `used` (or a later round's take, or a release) drops them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while any(key not in self._held and can_come(key[0]) for key in wanted):
            left = deadline - loop.time()
            if left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                break
        taken: dict[Key, Pushed] = {}
        for key, (limit, depth) in wanted.items():
            held = self._held.get(key)
            self._drop_older(key)
            if held is None:
                reason = (
                    f"no drafts pushed for request {key[0]!r} round {key[1]} within {wait_s:g} s"
                    if can_come(key[0])
                    else f"request {key[0]!r}: its draft replica's streams have ended"
                )
                taken[key] = Pushed(error=CallFailed(grpc.StatusCode.UNAVAILABLE, reason))
            else:
                taken[key] = checked(held[0], limit, depth, vocab_size, held[1])
        return taken

    def used(self, keys: Iterable[Key]) -> None:
        """Drops drafts a step verified. Those of an item that did not run (no KV room now) stay for its retry."""
        for key in keys:
            self._held.pop(key, None)

    def release(self, request_ids: Iterable[str]) -> None:
        released = set(request_ids)
        for key in [key for key in self._held if key[0] in released]:
            del self._held[key]

    def _drop_older(self, key: Key) -> None:
        for older in [k for k in self._held if k[0] == key[0] and k[1] < key[1]]:
            del self._held[older]


def checked(drafts: target_pb2.PushedDrafts, limit: int, depth: int, vocab_size: int, compute_seconds: float) -> Pushed:
    """A push as the step verifies it, cut to at most `limit` drafts `depth` deep (0: any depth), or why it has
    none."""
    if drafts.HasField("error"):
        return Pushed(error=CallFailed.from_proto(drafts.error), compute_seconds=compute_seconds)
    tokens, parents = list(drafts.draft_tokens), list(drafts.parents)
    fault = ""
    if any(not 0 <= token < vocab_size for token in tokens):
        fault = f"draft ids outside the vocabulary [0, {vocab_size})"
    elif parents:
        try:
            check_tree(parents, len(tokens), "parents")
        except ValueError as error:
            fault = str(error)
    if fault:
        message = f"pushed drafts of request {drafts.request_id!r}: {fault}"
        return Pushed(error=CallFailed(grpc.StatusCode.INVALID_ARGUMENT, message), compute_seconds=compute_seconds)
    if not parents:
        return Pushed(tuple(tokens[: min(limit, depth or limit)]), (), None, compute_seconds)
    kept_tokens, kept_parents = cut_tree(tokens, parents, limit, depth)
    return Pushed(kept_tokens, kept_parents, None, compute_seconds)


def cut_tree(
    tokens: Sequence[int], parents: Sequence[int], limit: int, depth: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The nodes of a checked tree kept in order while there is room (`limit` nodes), each within `depth` (0: any)
    and under a kept parent, with their parents renumbered among the kept: again a tree whose parents come first."""
    index_of: dict[int, int] = {-1: -1}  # old index -> new index; -1 the last committed token
    depth_of = {-1: 0}
    kept_tokens: list[int] = []
    kept_parents: list[int] = []
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        if len(kept_tokens) == limit:
            break
        if parent not in index_of or (depth and depth_of[parent] + 1 > depth):
            continue
        index_of[node] = len(kept_tokens)
        depth_of[node] = depth_of[parent] + 1
        kept_tokens.append(token)
        kept_parents.append(index_of[parent])
    return tuple(kept_tokens), tuple(kept_parents)
