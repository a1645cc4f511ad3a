"""A replica's prefix cache (draft_server.prefixes) on a tiny EAGLE3 head: rows that skip a prefix take its draft KV
from the cache and draft exactly what a whole ingest drafts; a prefix whose blocks are not all there (another token,
another salt, the token after a block: the one-token shift) is answered as needing a replay, holding nothing. A block
drafter's context has no shift: a prefix that differs only in the token after a block is found whole."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from draft_server.prefixes import RequestPrefix
from draft_server.proposals import propose_what_fits
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.models.eagle3 import Eagle3Draft
from tandem.settings import KVCacheSettings
from tests.helpers.target_rows import random_rows
from tests.unit.test_dflash import runner_for, written
from tests.unit.test_runners import direct_proposal, draft, draft_dir, target_dir  # noqa: F401 (fixtures)

CACHE = KVCacheSettings(num_blocks=32, block_size=4)
FIRST = 1  # x[0], which no row carries


def whole(rows: TargetRows, salt: str = "") -> TargetRows:
    """Rows from position 0, naming their request's prefix as the target does."""
    return replace(rows, prefix=RequestPrefix((FIRST,), salt))


def skipping(rows: TargetRows, start: int, salt: str = "") -> TargetRows:
    """The rows of positions [start, ...) of `rows`, as the target sends them after its cache gave it [0, start)."""
    tokens = (FIRST, *rows.next_tokens[:start])
    return TargetRows(start, rows.next_tokens[start:], rows.features[start:], RequestPrefix(tokens, salt))


def test_rows_after_a_cached_prefix_draft_what_the_whole_rows_draft(draft: Eagle3Draft) -> None:  # noqa: F811
    runner = DraftRunner(draft, CACHE)
    rows = random_rows(0, 13, seed=11)
    first = propose_what_fits(runner, [ProposeInput("a", whole(rows), num_steps=3)])
    again = propose_what_fits(runner, [ProposeInput("b", skipping(rows, 8), num_steps=3)])
    assert (again.prefix, again.exhausted) == ({"b": (8, 8)}, {})
    assert again.drafts["b"] == first.drafts["a"]
    assert again.drafts["b"].tokens == tuple(direct_proposal(draft, rows, 3))
    assert runner.requests["b"].kv.block_ids[:2] == runner.requests["a"].kv.block_ids[:2]


@pytest.mark.parametrize(
    ("change", "found"),
    [
        (lambda tokens: [tokens[0] + 1, *tokens[1:]], 0),  # the first row's token: every block renamed
        (lambda tokens: [*tokens[:7], tokens[7] + 1, *tokens[8:]], 4),  # x[8]: the token after block 1
    ],
    ids=["first-token", "token-after-the-block"],
)
def test_a_prefix_not_all_cached_needs_a_replay_and_holds_nothing(draft: Eagle3Draft, change, found: int) -> None:  # noqa: F811
    runner = DraftRunner(draft, CACHE)
    rows = random_rows(0, 13, seed=12)
    propose_what_fits(runner, [ProposeInput("a", whole(rows), num_steps=2)])
    free = runner.cache.num_free_blocks
    other = TargetRows(0, change(list(rows.next_tokens)), rows.features)
    missed = propose_what_fits(runner, [ProposeInput("b", skipping(other, 8), num_steps=2)])
    assert missed.drafts == {} and "b" in missed.exhausted and "needs a replay" in missed.exhausted["b"]
    assert f"holds the draft context of {found} of those positions" in missed.exhausted["b"]
    assert missed.prefix == {"b": (8, 0)}
    assert "b" not in runner.requests and runner.cache.num_free_blocks == free


def test_salts_and_a_cache_switched_off_share_nothing(draft: Eagle3Draft) -> None:  # noqa: F811
    rows = random_rows(0, 13, seed=13)
    runner = DraftRunner(draft, CACHE)
    propose_what_fits(runner, [ProposeInput("a", whole(rows, salt="tenant"), num_steps=2)])
    assert "b" in propose_what_fits(runner, [ProposeInput("b", skipping(rows, 8), num_steps=2)]).exhausted
    assert propose_what_fits(runner, [ProposeInput("c", skipping(rows, 8, "tenant"), 2)]).prefix == {"c": (8, 8)}
    plain = DraftRunner(draft, replace(CACHE, prefix_caching=False))
    assert plain.prefixes is None


def test_an_images_mark_names_the_draft_blocks_from_the_first_row_it_touches(draft: Eagle3Draft) -> None:  # noqa: F811
    # An image from token 8: with the one-token shift, row 7 (next token x[8]) is the first to depend on it, so draft
    # block 1 (rows 4..7) and later ones carry its digest; block 0 is shared by any image, blocks 0-1 by the same.
    rows = random_rows(0, 13, seed=14)
    runner = DraftRunner(draft, CACHE)
    image = RequestPrefix((FIRST,), "", ((8, "aa"),))
    propose_what_fits(runner, [ProposeInput("a", replace(rows, prefix=image), num_steps=2)])
    for name, digest, start, found in (("b", "bb", 4, 4), ("c", "cc", 8, 0), ("d", "aa", 8, 8)):
        tail = skipping(rows, start)
        assert tail.prefix is not None
        asked = replace(tail, prefix=replace(tail.prefix, marks=((8, digest),)))
        attached = propose_what_fits(runner, [ProposeInput(name, asked, num_steps=2)])
        assert attached.prefix == {name: (start, found)}


@pytest.fixture(scope="module")
def block_drafter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return written("llama-dflash", tmp_path_factory)


def test_a_block_drafters_prefix_is_found_whatever_token_follows_it(block_drafter: tuple[Path, Path]) -> None:
    target_path, draft_path = block_drafter
    runner = runner_for(draft_path, target_path)
    assert runner.prefixes is not None and runner.prefixes.shift == 0 and runner.block_size == 4
    width = runner.model.fc.in_features
    rows = random_rows(0, 13, seed=14, width=width)
    propose_what_fits(runner, [ProposeInput("a", whole(rows), num_steps=3)])
    tokens = list(rows.next_tokens)
    tokens[7] += 1  # x[8], the token after block 1: an EAGLE3 head finds 4 positions of 8 (above)
    other = TargetRows(0, tokens, rows.features)
    again = propose_what_fits(runner, [ProposeInput("b", skipping(other, 8), num_steps=3)])
    assert (again.prefix, again.exhausted) == ({"b": (8, 8)}, {})
    fresh = runner_for(draft_path, target_path)
    assert again.drafts["b"] == propose_what_fits(fresh, [ProposeInput("b", whole(other), num_steps=3)]).drafts["b"]
    assert runner.requests["b"].kv.block_ids[:2] == runner.requests["a"].kv.block_ids[:2]
    changed = TargetRows(0, [tokens[0] + 1, *tokens[1:]], rows.features)  # x[1], in block 0: nothing found
    missed = propose_what_fits(runner, [ProposeInput("c", skipping(changed, 8), num_steps=3)])
    assert missed.prefix == {"c": (8, 0)} and "c" in missed.exhausted
