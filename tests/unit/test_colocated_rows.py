"""The colocated engine's draft joins a request's rows of the rounds it drafted nothing for (k = 0) to the round it
is asked about, as a replica does (draft_server.runner.join_rounds); it once took the asked round's rows alone, so
that its runner saw a gap and the benchmark demoted its in-process draft."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from bench.colocated import LocalDraft
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput, TargetRows, join_rounds
from orchestrator.peers.backends import ProposeTask
from tandem.models.eagle3 import load_eagle3
from tandem.settings import KVCacheSettings
from target_server.items import CapturedRows, RowStream
from tests.helpers.checkpoints import TinyEagle3Spec, write_tiny_eagle3, write_tiny_target


def rows(start: int, count: int, width: int, seed: int) -> CapturedRows:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 40, (count,), generator=generator).tolist()
    return CapturedRows("a", start, tokens, torch.randn(count, width, generator=generator))


def test_rows_of_rounds_without_drafts_are_joined_to_the_asked_round(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target")
    draft_dir = write_tiny_eagle3(tmp_path / "draft", target, TinyEagle3Spec(include_embedding=True))
    model, _ = load_eagle3(draft_dir)
    width = model.fc.in_features
    cache = KVCacheSettings(num_blocks=32, block_size=4)
    prompt, round_one, round_two = rows(0, 6, width, 1), rows(6, 1, width, 2), rows(7, 2, width, 3)

    async def colocated() -> list[int]:
        draft = LocalDraft(DraftRunner(model, cache), RowStream((1, 2, 3)))
        draft.deliver(prompt, 1)
        await draft.propose([ProposeTask("a", 1, 3)])
        draft.deliver(round_one, 2)  # round 2 drafted nothing (k = 0): no Propose
        draft.deliver(round_two, 3)
        batch = await draft.propose([ProposeTask("a", 3, 3)])
        assert not draft.rows
        return list(batch.drafts["a"].tokens)

    # The same rows through a runner by hand: the prompt, then rounds 2 and 3 in one proposal.
    expected_runner = DraftRunner(model, cache)
    as_rows = [
        TargetRows(part.start_position, part.next_tokens, part.features) for part in (prompt, round_one, round_two)
    ]
    expected_runner.propose([ProposeInput("a", as_rows[0], 3)])
    (expected,) = expected_runner.propose([ProposeInput("a", join_rounds(as_rows[1:]), 3)])
    assert asyncio.run(colocated()) == list(expected)


def test_join_rounds_keeps_order_restarts_on_earlier_rows_and_refuses_a_gap() -> None:
    def part(start: int, count: int) -> TargetRows:
        return TargetRows(start, list(range(start, start + count)), torch.zeros(count, 2))

    joined = join_rounds([part(4, 1), part(5, 2), part(7, 1)])
    assert (joined.start_position, list(joined.next_tokens)) == (4, [4, 5, 6, 7])
    restarted = join_rounds([part(4, 1), part(0, 6)])  # a replay from scratch makes the earlier rows stale
    assert (restarted.start_position, len(restarted.next_tokens)) == (0, 6)
    with pytest.raises(DraftRequestError, match="do not continue"):
        join_rounds([part(4, 1), part(6, 1)])
