"""The acceptance watch: its log line per interval, and the warning and verdict when acceptance collapses."""

from __future__ import annotations

import logging

import pytest

from orchestrator.loop.acceptance import AcceptanceMonitor, AcceptanceWatch
from orchestrator.loop.output import Stats


def request_stats(rounds: int, accepted_per_position: list[int]) -> Stats:
    """A request's stats after `rounds` rounds with drafts, accepted_per_position[i] of which accepted position i."""
    return Stats(
        rounds=rounds,
        draft_rounds=rounds,
        draft_tokens=rounds * len(accepted_per_position),
        accepted_tokens=sum(accepted_per_position),
        accepted_per_position=list(accepted_per_position),
    )


def test_each_interval_logs_its_acceptance_and_a_collapse_warns(caplog: pytest.LogCaptureFixture) -> None:
    monitor = AcceptanceMonitor(AcceptanceWatch(min_drafts=32, collapsed_below=1.1))
    caplog.set_level(logging.INFO, logger="orchestrator.loop.acceptance")

    monitor.add(request_stats(20, [20, 15, 10]))  # a draft that fits: 45 accepted over 20 drafts
    monitor.add(request_stats(20, [20, 15, 10]))
    monitor.close_window()
    assert caplog.messages == ["acceptance: mean length 3.25 over 40 drafts, per position 1.00 0.75 0.50"]
    assert not monitor.collapsed

    caplog.clear()
    monitor.add(request_stats(40, [2, 0, 0]))  # a draft that almost never matches: 2 accepted over 40 drafts
    monitor.close_window()
    assert caplog.messages[0] == "acceptance: mean length 1.05 over 40 drafts, per position 0.05 0.00 0.00"
    assert caplog.records[1].levelno == logging.WARNING
    assert caplog.messages[1].startswith("acceptance collapsed: mean acceptance length 1.05 over 40 drafts")
    assert monitor.collapsed

    caplog.clear()
    monitor.add(request_stats(10, [0, 0, 0]))  # too few drafts to judge: logged, the verdict stays
    monitor.close_window()
    assert [record.levelno for record in caplog.records] == [logging.INFO]
    assert monitor.collapsed

    caplog.clear()
    monitor.close_window()  # an interval without drafts says nothing
    assert caplog.messages == []
    monitor.add(request_stats(40, [30, 20, 10]))
    monitor.close_window()
    assert not monitor.collapsed
