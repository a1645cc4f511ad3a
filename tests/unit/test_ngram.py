"""Prompt-lookup drafting (orchestrator/loop/ngram.py) on hand-built token lists, its settings and its command line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from launch.cli import build_parser
from launch.processes import ready_line
from launch.serve_command import serve_settings_of
from launch.service_commands import orchestrator_settings_of
from orchestrator.loop.ngram import NGRAM_REPLICA, NgramDrafter, add_ngram_replica, check_one_draft_kind, lookup
from orchestrator.peers.backends import ProposeTask
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import DiscoverySettings, NgramSettings, OrchestratorSettings
from tandem import flags
from tandem.errors import StartupError
from tandem.sampling.draft_tree import DraftTree


def test_the_longest_suffix_is_tried_first() -> None:
    # 3-token suffix 1 2 3 occurred at 0 (followed by 9); the 1-token suffix 3 most recently at 6 (followed by 7).
    tokens = [1, 2, 3, 9, 8, 8, 3, 7, 1, 2, 3]
    assert lookup(tokens, 2, min_n=1, max_n=3) == [9, 8]
    assert lookup(tokens, 2, min_n=1, max_n=1) == [7, 1]


def test_a_shorter_suffix_is_tried_when_the_longer_one_occurs_nowhere_earlier() -> None:
    # The worked example of lookup's docstring: 9 5 6 occurs nowhere earlier; 5 6 at 0 and 4.
    assert lookup([5, 6, 7, 8, 5, 6, 9, 5, 6], 2, min_n=1, max_n=3) == [9, 5]


def test_the_most_recent_earlier_match_wins() -> None:
    tokens = [4, 10, 4, 11, 4, 12, 4]
    assert lookup(tokens, 1, min_n=1, max_n=1) == [12]
    assert lookup(tokens, 3, min_n=1, max_n=1) == [12, 4, 12]  # 12 4, then the copy reads its own 12


def test_no_match_gives_no_drafts() -> None:
    assert lookup([1, 2, 3, 4, 5], 4, min_n=1, max_n=3) == []
    # The suffix itself is no earlier occurrence, and a 2-token suffix needs a 2-token match.
    assert lookup([7, 8, 9, 8], 4, min_n=2, max_n=3) == []
    assert lookup([7], 4, min_n=1, max_n=3) == []
    assert lookup([], 4, min_n=1, max_n=3) == []


def test_a_copy_that_reaches_the_end_of_the_tokens_goes_on_with_their_period() -> None:
    # The docstring's example: 1 2 at 0 is followed by 3 1 2, and the copy goes on over its own 3 1.
    assert lookup([1, 2, 3, 1, 2], 5, min_n=1, max_n=2) == [3, 1, 2, 3, 1]
    # 7 7 occurs earlier at 0 only, followed by one 7: a period of one token.
    assert lookup([7, 7, 7], 5, min_n=1, max_n=2) == [7, 7, 7, 7, 7]
    # A two-token loop gives k tokens a round, not the two that follow the last occurrence.
    assert lookup([5, 7, 8, 7, 8, 7, 8], 5, min_n=1, max_n=4) == [7, 8, 7, 8, 7]
    # Without reaching the end, the copy is the tokens that followed, as before.
    assert lookup([1, 2, 3, 4, 5, 6, 9, 1, 2], 3, min_n=1, max_n=2) == [3, 4, 5]


def test_at_most_k_tokens_are_proposed() -> None:
    tokens = [*range(20, 40), 5, *range(20, 22)]
    assert lookup(tokens, 4, min_n=1, max_n=2) == [22, 23, 24, 25]
    assert lookup(tokens, 0, min_n=1, max_n=2) == []


def test_byte_matches_across_token_boundaries_are_not_matches() -> None:
    # Token ids are 32-bit little-endian: 256 is the bytes 00 01 00 00, 1 is 01 00 00 00, so the bytes of [1, 0] also
    # appear one byte into [256, 0, 0]. There they are more recent than the real occurrence at 0, and are skipped.
    assert lookup([1, 0, 9, 256, 0, 0, 1, 0], 1, min_n=2, max_n=2) == [9]
    assert lookup([256, 0, 0, 7, 1, 0], 1, min_n=2, max_n=2) == []


def test_the_drafter_proposes_per_task_and_holds_nothing() -> None:
    drafter = NgramDrafter(NgramSettings(max_n=2, min_n=1))
    tasks = [ProposeTask("a", 3, 2, (1, 2, 3, 1, 2)), ProposeTask("b", 1, 4, (1, 2, 3))]
    batch = asyncio.run(drafter.propose(tasks))
    assert batch.drafts == {"a": DraftTree.chain([3, 1]), "b": DraftTree()}
    assert batch.exhausted == {}
    assert asyncio.run(drafter.release(["a", "b"])) is None


def test_the_replica_asks_the_target_for_no_hidden_rows() -> None:
    pool = ReplicaPool()
    add_ngram_replica(pool, NgramSettings())
    replica = pool.get(NGRAM_REPLICA)
    assert replica is not None and not replica.hidden_rows and replica.serving


@pytest.mark.parametrize(
    ("max_n", "min_n", "message"),
    [(4, 0, "--ngram-min: 0"), (2, 3, "--ngram-max: 2 is below --ngram-min 3")],
)
def test_bad_ngram_sizes_are_refused_naming_the_flag(max_n: int, min_n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramSettings(max_n=max_n, min_n=min_n)


def test_ngram_beside_draft_replicas_is_refused() -> None:
    base = OrchestratorSettings("127.0.0.1:1", (), Path("t"), ngram=NgramSettings())
    check_one_draft_kind(base)
    for mixed in (
        OrchestratorSettings("127.0.0.1:1", ("127.0.0.1:2",), Path("t"), ngram=NgramSettings()),
        OrchestratorSettings(
            "127.0.0.1:1", (), Path("t"), draft_discovery=DiscoverySettings("d", 1), ngram=NgramSettings()
        ),
    ):
        with pytest.raises(StartupError, match="--draft ngram drafts in the orchestrator"):
            check_one_draft_kind(mixed)


def test_serve_draft_ngram_gives_the_orchestrator_its_sizes_and_starts_no_draft() -> None:
    settings = serve_settings_of(build_parser().parse_args(["serve", "--draft", "ngram", "--ngram-max", "3"]))
    assert settings.ngram == NgramSettings(max_n=3, min_n=NgramSettings.min_n) and settings.draft_dir is None
    # The orchestrator's command line, as the launcher writes it, parses back to the same sizes.
    orchestrator = settings.orchestrator_settings("a", [], settings.admin_settings(), Path("http.url"))
    arguments = ["orchestrator", *flags.arguments_of(orchestrator)]
    assert orchestrator_settings_of(build_parser().parse_args(arguments)).ngram == settings.ngram
    line = ready_line(settings, "127.0.0.1:5", "2 processes")
    assert "speculative, n-gram drafts in the orchestrator" in line and "draft replicas" not in line


def test_ngram_sizes_without_draft_ngram_are_refused() -> None:
    args = build_parser().parse_args(["serve", "--ngram-max", "3"])
    with pytest.raises(ValueError, match="--ngram-max and --ngram-min apply to --draft ngram and --hybrid-ngram only"):
        serve_settings_of(args)
    args = build_parser().parse_args(["serve", "--draft", "ngram", "--ngram-min", "5"])
    with pytest.raises(ValueError, match="--ngram-max: 4 is below --ngram-min 5"):
        serve_settings_of(args)
