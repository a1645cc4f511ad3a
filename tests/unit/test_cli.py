"""The `tandem` command line: what the settings' options reach in the children's command lines, and what the settings
refuse together."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from launch import processes
from launch.cli import build_parser, main
from launch.processes import Launcher
from launch.serve_command import serve_settings_of
from launch.serve_settings import ServeSettings
from launch.service_commands import draft_settings_of, orchestrator_settings_of, target_settings_of
from launch.stack_security import ServeSecurity
from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem import flags
from tandem.grpc_util import KEEPALIVE_TIMEOUT_S
from tandem.settings import TreeShape, log_level
from target_server.rank import parse_arguments
from target_server.ranks import rank_command

ORCHESTRATOR = ["orchestrator", "--target-address", "a", "--tokenizer", "t"]


def serve_settings(*arguments: str) -> ServeSettings:
    return serve_settings_of(build_parser().parse_args(["serve", "--target", "t", "--draft", "d", *arguments]))


def orchestrator_of(settings: ServeSettings) -> list[str]:
    """The orchestrator child's command line, as the process launcher writes it."""
    orchestrator = settings.orchestrator_settings("a", [], settings.admin_settings(), Path("http.url"))
    return ["orchestrator", *flags.arguments_of(orchestrator)]


def test_serve_thread_options_reach_the_draft_and_target_command_lines() -> None:
    launcher = Launcher(serve_settings("--target-threads", "2", "--draft-threads", "1"))
    target = build_parser().parse_args([*launcher.target_arguments(), "--port", "0"])
    draft = build_parser().parse_args([*launcher.draft_arguments("draft-0"), "--port", "0"])
    assert (target_settings_of(target).threads, draft_settings_of(draft).threads) == (2, 1)
    assert draft_settings_of(draft).replica_id == "draft-0"


@pytest.mark.parametrize("command", [["target", "--model", "m"], ["draft", "--model", "m", "--target-address", "a"]])
def test_a_negative_thread_count_is_refused_with_the_value(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--threads", "-2"])
    assert "-2: a thread count is 0 (the default) or more" in capsys.readouterr().err
    assert build_parser().parse_args(command).threads == 0


def test_tree_flags_reach_the_draft_and_orchestrator_command_lines() -> None:
    tree = ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3"]
    settings = serve_settings(*tree)
    assert settings.scheduler.tree == TreeShape(4, 8)
    draft = build_parser().parse_args([*Launcher(settings).draft_arguments("draft-0"), "--port", "0"])
    assert draft_settings_of(draft).tree == TreeShape(4, 8)
    orchestrator = build_parser().parse_args(orchestrator_of(settings))
    assert orchestrator_settings_of(orchestrator).scheduler.tree == TreeShape(4, 8)


def test_a_chain_gets_its_draft_tokens_from_the_steps_given() -> None:
    assert serve_settings("--speculative-num-steps", "3").scheduler.tree == TreeShape(1, 4)


@pytest.mark.parametrize(
    ("flags_given", "message"),
    [
        (["--speculative-num-draft-tokens", "8"], "--speculative-num-draft-tokens 8 with --speculative-eagle-topk 1"),
        (["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "12"], "between 2 and"),
    ],
)
def test_inconsistent_tree_flags_stop_the_command_naming_them(flags_given: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["serve", "--speculative-num-steps", "3", *flags_given])


def test_every_scheduler_flag_of_serve_reaches_the_orchestrator_command_line() -> None:
    settings = serve_settings(
        "--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
        "--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--max-waiting", "9", "--num-scheduler-steps", "2",
        "--no-adaptive-k", "--target-timeout", "12.5", "--draft-timeout", "3.5", "--hybrid-ngram", "--ngram-max", "5",
        "--draft-ahead", "0",
    )  # fmt: skip
    scheduler = settings.scheduler
    orchestrator = orchestrator_settings_of(build_parser().parse_args(orchestrator_of(settings)))
    assert orchestrator.scheduler == scheduler
    assert (scheduler.num_steps, scheduler.max_num_batched_tokens, scheduler.draft_timeout_s) == (4, 300, 3.5)
    assert not scheduler.adaptive_k and scheduler.draft_ahead == 0  # both differ from their defaults
    assert scheduler.hybrid == HybridSettings(NgramSettings(max_n=5, min_n=HybridSettings().ngram.min_n))


def test_serve_draft_ngram_reaches_the_orchestrator_and_starts_no_draft() -> None:
    settings = serve_settings_of(build_parser().parse_args(["serve", "--target", "t", "--draft", "ngram"]))
    assert (settings.draft_dir, settings.ngram) == (None, NgramSettings())
    orchestrator = orchestrator_settings_of(build_parser().parse_args(orchestrator_of(settings)))
    assert orchestrator.ngram == NgramSettings() and orchestrator.scheduler.hybrid is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--ngram-max", "3"], "--ngram-max and --ngram-min apply to --draft ngram and --hybrid-ngram only"),
        (["--draft", "ngram", "--ngram-min", "5"], "--ngram-max: 4 is below --ngram-min 5"),
        (["--draft", "ngram", "--hybrid-ngram"], "--hybrid-ngram merges n-gram drafts into a draft model's;"),
        (["--target", "t", "--hybrid-ngram"], "--hybrid-ngram merges n-gram drafts into a draft model's: give --draft"),
        (["--draft", "ngram", "--draft-replicas", "2"], "--draft ngram drafts in the orchestrator and starts no"),
        (["--ray-address", "ray://head:10001"], "--ray-address needs --launcher ray"),
    ],
)
def test_serve_refuses_flags_that_do_not_fit_together_naming_them(arguments: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["serve", *arguments])


def test_the_ray_launcher_is_refused_on_a_gpu_naming_both() -> None:
    with pytest.raises(ValueError, match="--launcher ray: places services on CPUs only for now, not cuda:0"):
        ServeSettings(Path("t"), Path("d"), launcher="ray", device="cuda:0")


def test_the_orchestrator_refuses_both_kinds_of_ngram_drafts() -> None:
    with pytest.raises(SystemExit, match="--hybrid-ngram merges n-gram drafts into a draft model's"):
        main([*ORCHESTRATOR, "--draft", "ngram", "--hybrid-ngram"])


def test_serve_settings_are_checked_however_they_are_built() -> None:
    hybrid = SchedulerSettings(hybrid=HybridSettings())
    with pytest.raises(ValueError, match="--hybrid-ngram merges n-gram drafts into a draft model's: give --draft"):
        ServeSettings(Path("t"), None, scheduler=hybrid)
    with pytest.raises(ValueError, match="--draft-replicas 9 is above --max-draft-replicas"):
        ServeSettings(Path("t"), Path("d"), draft_replicas=9, security=ServeSecurity(max_draft_replicas=8))


def test_no_http_turns_the_http_api_off_and_the_orchestrator_gets_none() -> None:
    settings = serve_settings("--no-http")
    assert settings.http_port is None
    orchestrator = orchestrator_settings_of(build_parser().parse_args(orchestrator_of(settings)))
    assert orchestrator.http.port is None and orchestrator.http.ready_file is None
    assert serve_settings().http_port == ServeSettings.http_port


def test_serve_media_flags_reach_the_orchestrator_and_the_image_limit_the_target() -> None:
    settings = serve_settings(
        "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "a.example", "b.example",
        "--allowed-local-media-path", "/srv/media",
    )  # fmt: skip
    http = orchestrator_settings_of(build_parser().parse_args(orchestrator_of(settings))).http
    assert (http.allowed_media_domains, http.allowed_local_media_path) == (
        ("a.example", "b.example"),
        Path("/srv/media"),
    )
    target = build_parser().parse_args([*Launcher(settings).target_arguments(), "--port", "0"])
    assert target_settings_of(target).images == 2
    # None given: the orchestrator fetches nothing, the target loads no tower.
    plain = orchestrator_settings_of(build_parser().parse_args(orchestrator_of(serve_settings()))).http
    assert (plain.allowed_media_domains, plain.allowed_local_media_path) == ((), None)


def test_the_kv_pool_is_sized_one_way_and_the_children_get_that_way(capsys: pytest.CaptureFixture[str]) -> None:
    settings = serve_settings("--kv-cache-memory", "1MiB")
    target = target_settings_of(build_parser().parse_args([*Launcher(settings).target_arguments(), "--port", "0"]))
    assert target.cache == settings.cache and target.cache.memory_bytes == 1 << 20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-blocks", "8", "--kv-cache-memory", "1MiB"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_service_commands_round_trip_the_settings_the_launcher_gives_them() -> None:
    flags = ("--tp", "2", "--block-size", "8", "--mtp-mode", "independent", "--dequantize")
    settings = serve_settings(*flags, "--image-embeddings", "merged")
    launcher = Launcher(settings)
    target = target_settings_of(build_parser().parse_args([*launcher.target_arguments(), "--port", "0"]))
    assert target == settings.target_settings()
    draft = draft_settings_of(build_parser().parse_args([*launcher.draft_arguments("draft-3"), "--port", "0"]))
    assert draft == settings.draft_settings("draft-3", "")
    assert (target.tp, target.cache.block_size, draft.mtp_mode, target.dequantize) == (2, 8, "independent", True)
    assert draft.image_embeddings == "merged"


def test_a_target_rank_gets_rank_0_s_settings_through_its_command_line() -> None:
    settings = serve_settings("--tp", "2", "--kv-cache-memory", "1MiB", "--target-threads", "1", "--dequantize")
    command = rank_command(settings.target_settings(), 1, "127.0.0.1:9")
    assert command[1:3] == ["-m", "target_server.rank"]
    assert parse_arguments(command[3:]) == (replace(settings.target_settings(), rendezvous="127.0.0.1:9"), 1)
    assert settings.target_settings().dequantize


def test_the_keepalive_timeout_reaches_every_child_and_is_at_least_a_second(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(processes, "_started", lambda command, environment: commands.append(command))
    launcher = Launcher(serve_settings("--keepalive-timeout", "2.5"))
    launcher._spawn("target", launcher.target_arguments())
    launcher._spawn("draft-0", launcher.draft_arguments("draft-0"))
    launcher._spawn("orchestrator", orchestrator_of(launcher.settings))
    assert [command[:3] for command in commands] == [[sys.executable, "-m", "launch.cli"]] * 3
    assert [build_parser().parse_args(command[3:]).keepalive_timeout for command in commands] == [2.5] * 3
    assert serve_settings().keepalive_timeout_s == KEEPALIVE_TIMEOUT_S == 10.0
    with pytest.raises(SystemExit):
        build_parser().parse_args([*ORCHESTRATOR, "--keepalive-timeout", "0.5"])
    assert "0.5: a keepalive timeout must be at least 1 second" in capsys.readouterr().err


def test_a_block_drafter_drafts_its_whole_block_unless_told_otherwise(tmp_path: Path) -> None:
    block = tmp_path / "dflash"
    block.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 3, "block_size": 16}}
    (block / "config.json").write_text(json.dumps(config))

    def steps(*arguments: str) -> int:
        args = build_parser().parse_args(["serve", "--target", "t", "--draft", str(block), *arguments])
        settings = serve_settings_of(args)
        assert settings.draft_settings("r", "a").num_steps == settings.scheduler.num_steps
        return settings.scheduler.num_steps

    assert steps() == 15
    assert steps("--speculative-num-steps", "6") == 6
    (block / "config.json").write_text(json.dumps(config | {"architectures": ["DFlash2DraftModel"]}))
    assert steps() == 15  # DFlash2 drafts from block rows 1 .., as DFlash does
    assert serve_settings().scheduler.num_steps == SchedulerSettings.num_steps  # a draft that is no block drafter


def test_the_log_level_comes_from_the_environment_and_a_wrong_one_stops_serve_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("TANDEM_LOG_LEVEL", raising=False)
    assert log_level() == "INFO"
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "debug")
    assert log_level() == "DEBUG"
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "chatty")
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--target", "t", "--draft", "d"])
    assert "TANDEM_LOG_LEVEL='chatty' is not one of DEBUG, INFO, WARNING, ERROR" in str(stopped.value)
    # A service started by hand refuses it too, before it loads anything.
    assert main(["draft", "--target-address", "a", "--model", "m"]) == 2
    assert "draft cannot start: TANDEM_LOG_LEVEL='chatty'" in caplog.text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{image: 2}", "not JSON"),
        ('{"video": 1}', 'only "image" is served'),
        ('{"image": -1}', '"image" takes a count, 0 or more'),
        ('{"image": true}', '"image" takes a count, 0 or more'),
    ],
)
def test_image_limits_are_read_from_json_or_refused_naming_the_fault(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    three = parser.parse_args(["target", "--model", "m", "--limit-mm-per-prompt", '{"image": 3}'])
    assert three.limit_mm_per_prompt == 3
    assert parser.parse_args(["target", "--model", "m"]).limit_mm_per_prompt == 0  # no tower unless asked
    with pytest.raises(SystemExit):
        parser.parse_args(["target", "--model", "m", "--limit-mm-per-prompt", value])
    assert message in capsys.readouterr().err
