"""A replica's prefix cache: the draft KV it built for a prefix, kept and reused when the target skips that prefix.

When the target takes a request's first positions from its own prefix cache it computes no rows for them, so the
rows that start the request begin at s > 0 and carry its tokens x[0..s] (HiddenStates.prefix_tokens). The replica
then needs the draft KV of positions [0, s) from its own cache; a request whose draft KV this replica does not hold
in full is answered as needing a replay (the target then recomputes every row), so it never drafts from part of its
context.

Names: the draft KV of row position p depends on x[0..p + shift] (and the request's cache_salt). Shift 1 for
EAGLE-style drafts, whose row p pairs the target's feature of p with the token after it: a draft block is named by
the chain of tandem.layers.block_pool over the rows' next tokens x[1..] with x[0] in the seed, so block j, rows
[jb, (j + 1)b), is named by x[0..(j + 1)b]. Shift 0 for block drafters, whose context of p is the feature of p
alone: a draft block is named by x[0..(j + 1)b - 1], as the target names its own block, and the target reuses every
block it finds for them (SubscribeRequest.prefix_shift). A block is named once the rows of all its positions are
ingested: rows are committed positions, so their draft KV is final.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.layers.block_pool import Marks
from tandem.layers.kv_cache import PagedKVCache, SequenceKV

if TYPE_CHECKING:
    from draft_server.runner import ProposeInput, TargetRows


@dataclass(frozen=True)
class RequestPrefix:
    """What the rows that start a request over name it by (HiddenStates.prefix_tokens, cache_salt)."""

    tokens: tuple[int, ...]  # x[0 .. the rows' start position]
    salt: str
    marks: Marks = ()  # its images' (first token, digest), which name its blocks from the image's on


@dataclass
class DraftNames:
    """What names a request's draft blocks: its salt (with x[0] when shifted), and the tokens its rows depend on."""

    salt: str
    tokens: list[int]  # x[shift..]: at index p, the last token row p's draft KV depends on
    marks: Marks = ()  # by index into tokens: an image's digest at the first row that depends on the image


class HoldsPrefix(Protocol):
    kv: SequenceKV  # the request's draft KV in the runner's pool, row position p at KV position p
    names: DraftNames | None  # None: its rows did not start with its prefix named, so its blocks stay unnamed


def seeded_salt(salt: str, first_token: int) -> str:
    """The salt of a shifted request's draft names: its cache_salt and x[0] (the digits end at the first colon)."""
    return f"{first_token}:{salt}"


@dataclass(frozen=True)
class Attached:
    """What a batch's prefixes gave: per request whose rows skipped positions, (positions skipped, positions found in
    the cache: all, or 0); the requests whose skipped positions were not all found, and why."""

    prefix: dict[str, tuple[int, int]]
    missing: dict[str, str]


class DraftPrefixes:
    """The reuse and naming of a runner's draft blocks; `request_for` gives (making it if new) a request's state;
    `shift`: row p's draft KV depends on x[0..p + shift] (1: EAGLE-style heads, 0: block drafters)."""

    def __init__(self, cache: PagedKVCache, request_for: Callable[[str], HoldsPrefix], shift: int) -> None:
        self.cache = cache
        self.request_for = request_for
        self.shift = shift

    def attach(self, inputs: Sequence[ProposeInput]) -> Attached:
        """Names the requests whose rows start over, and gives those whose rows start past what they hold the
        cached draft KV of the positions before their rows."""
        prefix: dict[str, tuple[int, int]] = {}
        missing: dict[str, str] = {}
        for item in inputs:
            rows = item.rows
            if rows.prefix is None:
                continue
            start = rows.start_position
            request = self.request_for(item.request_id)
            tokens = list(rows.prefix.tokens)
            salt = seeded_salt(rows.prefix.salt, tokens[0]) if self.shift else rows.prefix.salt
            # Row p depends on x[p + shift]: an image from token q on first touches row q - shift.
            marks = tuple((max(0, position - self.shift), key) for position, key in rows.prefix.marks)
            request.names = DraftNames(salt, tokens[self.shift : start + 1], marks)
            if start <= 0 or request.kv.length >= start:
                continue
            self.cache.truncate(request.kv, 0)
            found = self.cache.reuse(request.kv, request.names.tokens, request.names.salt, start, marks)
            prefix[item.request_id] = (start, found if found == start else 0)
            if found < start:
                self.cache.truncate(request.kv, 0)
                missing[item.request_id] = (
                    f"its rows start at {start} after the target's prefix cache, and this replica's cache holds the "
                    f"draft context of {found} of those positions; it needs a replay"
                )
        return Attached(prefix, missing)

    def ingested(self, request: HoldsPrefix, rows: TargetRows) -> None:
        """Names the request's blocks that the ingest of `rows` filled; its KV ends where the rows end."""
        names = request.names
        if names is None:
            return
        first = rows.start_position + 1 - self.shift  # the index of the first row's next token
        if rows.start_position < 0 or len(names.tokens) < first:  # a gap: its tokens are not all known here
            request.names = None
            return
        names.tokens[first:] = rows.next_tokens
        self.cache.publish(request.kv, names.tokens, names.salt, names.marks)
