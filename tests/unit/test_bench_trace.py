"""bench.trace's reading of the processes' logs, on hand-written events."""

from __future__ import annotations

from pathlib import Path

from bench.trace import Event, follow, read_events


def test_each_event_is_followed_to_the_first_later_occurrence_of_the_next() -> None:
    events = [Event(at, name) for at, name in [(0, "a"), (1, "c"), (2, "b"), (3, "a"), (5, "b"), (6, "c"), (9, "b")]]
    # From a at 0: the first b after it is at 2, the first c after that at 6. From a at 3: b at 5, c at 6.
    assert follow(events, ("a", "b", "c")) == [[0, 2, 6], [3, 5, 6]]
    assert follow(events, ("c", "a", "c")) == [[1, 3, 6]]  # the c at 6 has no a after it
    assert follow(events, ("x", "a")) == []


def test_a_walk_much_longer_than_the_median_is_left_out() -> None:
    names = ["a", "b"] * 4
    times = [0, 10, 100, 110, 200, 210, 300, 10_000]  # the last a is answered after a long gap: another round's b
    walks = follow([Event(at, name) for at, name in zip(times, names, strict=True)], ("a", "b"))
    assert walks == [[0, 10], [100, 110], [200, 210]]


def test_logs_are_read_by_the_role_of_their_process(tmp_path: Path) -> None:
    (tmp_path / "1.log").write_text("/x/launch/cli.py target --model\n5 runner_end\n1 step_in\n")
    (tmp_path / "2.log").write_text("/x/launch/cli.py draft --model\n3 rows_arrived\n")
    (tmp_path / "3.log").write_text("/x/launch/cli.py bench --draft\n2 runner_start\n")  # the benchmark's own
    assert read_events(tmp_path) == [
        Event(1, "target:step_in"),
        Event(3, "draft:rows_arrived"),
        Event(5, "target:runner_end"),
    ]
