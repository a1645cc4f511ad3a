"""The load test's arithmetic and checks: percentiles, the stream draw, refusals naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load import draw_streams
from bench.load_report import percentile
from bench.load_settings import LoadSettings
from bench.memory import report_order

SETTINGS = LoadSettings(target_dir=Path("target"), draft_dir=Path("draft"))


def test_percentile_interpolates_between_the_closest_ranks() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    # rank (5 - 1) * 0.9 = 3.6: 60% of the way from 4 to 5.
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_streams_are_drawn_within_the_ranges_from_the_corpus_and_repeat_with_the_seed() -> None:
    settings = LoadSettings(Path("t"), Path("d"), streams=50, prompt_tokens=(3, 30), new_tokens=(2, 9))
    corpus = list(range(1000, 1020))  # shorter than the longest prompt: windows wrap around it
    streams = draw_streams(settings, corpus)
    assert [stream.index for stream in streams] == list(range(50))
    for stream in streams:
        assert 3 <= len(stream.input_ids) <= 30 and 2 <= stream.max_new_tokens <= 9
        first = corpus.index(stream.input_ids[0])
        assert list(stream.input_ids) == [corpus[(first + i) % 20] for i in range(len(stream.input_ids))]
    assert len({len(stream.input_ids) for stream in streams}) > 10  # mixed lengths
    assert draw_streams(settings, corpus) == streams


def test_the_default_pool_is_several_times_smaller_than_the_default_demand_yet_holds_the_longest_stream() -> None:
    SETTINGS.check()
    mean_tokens = sum(SETTINGS.prompt_tokens) / 2 + sum(SETTINGS.new_tokens) / 2
    assert SETTINGS.streams * SETTINGS.blocks(int(mean_tokens)) > 5 * SETTINGS.kv_blocks


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"streams": 0}, "--streams must be at least 1, got 0"),
        ({"prompt_tokens": (0, 5)}, "--prompt-tokens takes MIN MAX with 1 <= MIN <= MAX, got 0 5"),
        ({"new_tokens": (9, 2)}, "--max-new-tokens takes MIN MAX with 1 <= MIN <= MAX, got 9 2"),
        ({"kv_blocks": 32}, "--kv-blocks 32: the longest stream (400 prompt + 128 new tokens) needs 33 blocks"),
        ({"timeout_s": 0.0}, "--timeout must be above 0 seconds, got 0.0"),
    ],
)
def test_settings_that_cannot_make_a_load_test_are_refused_naming_the_flag(
    changes: dict[str, object], message: str
) -> None:
    settings = LoadSettings(Path("t"), Path("d"), **changes)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as raised:
        settings.check()
    assert message in str(raised.value)


def test_processes_are_reported_launcher_target_drafts_orchestrator_then_the_rest() -> None:
    names = ["python3-77", "orchestrator", "draft-1", "serve", "draft-0", "target"]
    assert sorted(names, key=report_order) == ["serve", "target", "draft-0", "draft-1", "orchestrator", "python3-77"]
