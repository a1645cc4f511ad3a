"""The backoff before a dead service starts again (launch.restarts), shared by both launchers: 1 s after a long run,
doubling while it dies again sooner, capped at 30 s."""

from __future__ import annotations

from launch.restarts import FIRST_BACKOFF_S, MAX_BACKOFF_S, RESET_AFTER_S, Backoff


def test_waits_double_while_a_service_dies_soon_after_each_start_up_to_the_cap() -> None:
    backoff = Backoff(started=0.0)
    waits = []
    now = 5.0
    for _ in range(7):
        waits.append(backoff.next_wait(now))
        backoff.started = now + waits[-1]  # started again, and dies 5 s later
        now = backoff.started + 5.0
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]


def test_a_long_run_resets_the_wait() -> None:
    backoff = Backoff(started=0.0, backoff_s=16.0)
    assert backoff.next_wait(RESET_AFTER_S) == FIRST_BACKOFF_S
