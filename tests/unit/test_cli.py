"""The `tandem` command line: what the thread options reach, and what they refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.cli import build_parser, main, scheduler_settings_of, tree_shape_of
from launch.processes import Launcher, ServeSettings
from tandem.settings import TreeShape


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


def test_tree_flags_reach_the_draft_and_orchestrator_command_lines() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--speculative-eagle-topk",
            "4",
            "--speculative-num-draft-tokens",
            "8",
            "--speculative-num-steps",
            "3",
        ]
    )
    settings = ServeSettings(target_dir=Path("t"), draft_dir=Path("d"), scheduler=scheduler_settings_of(args))
    launcher = Launcher(settings)
    for command in (
        launcher.draft_arguments("draft-0", "127.0.0.1:1"),
        ["orchestrator", *launcher.scheduler_arguments()],
    ):
        parsed = build_parser().parse_args(
            [*command, "--port", "0", *(["--target-address", "a", "--tokenizer", "t"] if command[0] != "draft" else [])]
        )
        assert tree_shape_of(parsed) == TreeShape(4, 8)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-num-draft-tokens", "8"], "--speculative-num-draft-tokens 8 with --speculative-eagle-topk 1"),
        (["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "12"], "between 2 and"),
    ],
)
def test_inconsistent_tree_flags_stop_the_command_naming_them(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["serve", "--speculative-num-steps", "3", *flags])


def test_every_scheduler_flag_of_serve_reaches_the_orchestrator_command_line() -> None:
    flags = [
        "--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
        "--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--max-waiting", "9", "--num-scheduler-steps", "2",
        "--no-adaptive-k", "--target-timeout", "12.5", "--draft-timeout", "3.5", "--hybrid-ngram", "--ngram-max", "5",
    ]  # fmt: skip
    scheduler = scheduler_settings_of(build_parser().parse_args(["serve", *flags]))
    settings = ServeSettings(target_dir=Path("t"), draft_dir=Path("d"), scheduler=scheduler)
    arguments = Launcher(settings).scheduler_arguments()
    orchestrator = build_parser().parse_args(["orchestrator", "--target-address", "a", "--tokenizer", "t", *arguments])
    assert scheduler_settings_of(orchestrator) == scheduler
    assert (scheduler.num_steps, scheduler.max_num_batched_tokens, scheduler.draft_timeout_s) == (4, 300, 3.5)
    assert not scheduler.adaptive_k  # the flag differs from the default (on)
    assert scheduler.hybrid is not None and scheduler.hybrid.ngram.max_n == 5
