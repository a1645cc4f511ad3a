"""The `tandem` command line: what the thread options reach, and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cli import build_parser
from tandem.launcher import Launcher, ServeSettings


def test_serve_thread_options_reach_the_draft_and_target_command_lines() -> None:
    args = build_parser().parse_args(["serve", "--target-threads", "2", "--draft-threads", "1"])
    assert (args.target_threads, args.draft_threads) == (2, 1)
    settings = ServeSettings(
        target_dir=Path("t"), draft_dir=Path("d"), target_threads=args.target_threads, draft_threads=args.draft_threads
    )
    launcher = Launcher(settings)
    target = launcher.target_arguments()
    draft = launcher.draft_arguments("draft-0", "127.0.0.1:1")
    assert target[target.index("--threads") + 1] == "2"
    assert draft[draft.index("--threads") + 1] == "1"
    assert build_parser().parse_args([*target, "--port", "0"]).threads == 2
    assert build_parser().parse_args([*draft, "--port", "0"]).threads == 1


@pytest.mark.parametrize("command", [["target", "--model", "m"], ["draft", "--model", "m", "--target-address", "a"]])
def test_a_negative_thread_count_is_refused_with_the_value(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--threads", "-2"])
    assert "-2: a thread count is 0 (the default) or more" in capsys.readouterr().err
    assert build_parser().parse_args(command).threads == 0
