"""Flags generated from settings dataclasses (tandem.flags): defaults from the fields, argparse's own refusals, and
settings -> argv -> settings round trips, on small settings of this test and on the services' own."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from draft_server.settings import DraftSettings
from orchestrator.settings import HybridSettings, NgramSettings, OrchestratorSettings
from tandem import flags
from tandem.devices import DeviceRequest
from tandem.flags import flag, nested, optional, positive
from tandem.settings import KVCacheSettings, TreeShape
from target_server.settings import TargetSettings


@dataclass(frozen=True)
class Lookup:
    longest: int = field(default=4, metadata=flag("--longest", "longest suffix", parse=positive))
    shortest: int = field(default=1, metadata=flag("--shortest", "shortest suffix", parse=positive))


@dataclass(frozen=True)
class Merge:
    lookup: Lookup = field(default_factory=lambda: Lookup(shortest=3), metadata=nested())


@dataclass(frozen=True)
class Pool:
    blocks: int = field(default=64, metadata=flag("--blocks", "blocks", exclusive="pool"))
    memory: int = field(default=0, metadata=flag("--memory", "bytes", exclusive="pool"))
    timeout_s: float = field(default=2.5, metadata=flag("--timeout", "seconds"))


@dataclass(frozen=True)
class Service:
    model: Path = field(metadata=flag("--model", "model directory", parse=Path))
    mode: str = field(default="fast", metadata=flag("--mode", "how", choices=("fast", "exact")))
    verbose: bool = field(default=True, metadata=flag("--verbose", "say more"))
    peers: tuple[str, ...] = field(default=(), metadata=flag("--peer", "repeat per peer", repeat=True))
    sizes: tuple[int, ...] = field(default=(1, 8), metadata=flag("--sizes", "one run per size", count="+"))
    port: int | None = field(default=0, metadata=flag("--port", "0: free", parse=int, off="--no-port"))
    pool: Pool = field(default_factory=Pool, metadata=nested())
    lookup: Lookup | None = field(default=None, metadata=optional(Lookup, "--kind lookup"))
    merge: Merge | None = field(default=None, metadata=optional(Merge, "--merge", "merge a lookup in"))
    secret: str | None = None  # no option: the command fills it


def parser_of(settings: type, *extra: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test", exit_on_error=True)
    if extra:
        parser.add_argument(*extra)
    flags.add_options(parser, settings)
    return parser


def service_of(arguments: list[str]) -> Service:
    return flags.settings_of(Service, parser_of(Service, "--kind").parse_args(arguments), secret="s")


def test_defaults_come_from_the_dataclass() -> None:
    assert service_of(["--model", "m"]) == Service(Path("m"), secret="s")
    args = parser_of(Service, "--kind").parse_args(["--model", "m"])
    assert (args.mode, args.verbose, args.sizes, args.blocks, args.timeout) == ("fast", True, [1, 8], 64, 2.5)


def test_a_field_without_a_default_is_a_required_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser_of(Service, "--kind").parse_args([])
    assert "the following arguments are required: --model" in capsys.readouterr().err


def test_settings_round_trip_through_their_command_line() -> None:
    given = [
        "--model", "m", "--mode", "exact", "--no-verbose", "--peer", "a:1", "--peer", "b:2", "--sizes", "2", "3",
        "--no-port", "--memory", "4096", "--timeout", "0.5", "--merge", "--longest", "6",
    ]  # fmt: skip
    settings = service_of(given)
    assert settings == Service(
        Path("m"), "exact", False, ("a:1", "b:2"), (2, 3), None, Pool(memory=4096, timeout_s=0.5), None,
        Merge(Lookup(6, 3)), "s",
    )  # fmt: skip
    argv = flags.arguments_of(settings)
    assert "--blocks" not in argv  # of the exclusive pool flags, the one given
    assert service_of(argv) == settings
    assert flags.arguments_of(service_of(argv)) == argv


def test_a_bool_option_has_its_no_form_and_the_argv_writes_it() -> None:
    assert not service_of(["--model", "m", "--no-verbose"]).verbose
    assert service_of(["--model", "m", "--no-verbose", "--verbose"]).verbose
    assert "--no-verbose" in flags.arguments_of(Service(Path("m"), verbose=False))
    assert "--verbose" in flags.arguments_of(Service(Path("m")))


def test_a_value_outside_the_choices_is_refused_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parser_of(Service, "--kind").parse_args(["--model", "m", "--mode", "slow"])
    assert refused.value.code == 2
    assert "argument --mode: invalid choice: 'slow' (choose from 'fast', 'exact')" in capsys.readouterr().err


def test_a_parser_s_message_names_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser_of(Service, "--kind").parse_args(["--model", "m", "--longest", "0"])
    assert "argument --longest: 0: must be at least 1" in capsys.readouterr().err


def test_exclusive_options_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser_of(Service, "--kind").parse_args(["--model", "m", "--blocks", "8", "--memory", "4096"])
    assert "argument --memory: not allowed with argument --blocks" in capsys.readouterr().err


def test_optional_settings_take_the_defaults_of_their_own_field() -> None:
    merged = service_of(["--model", "m", "--merge"])
    assert merged.merge == Merge(Lookup(4, 3)) and merged.lookup is None
    looked_up = service_of(["--model", "m", "--kind", "lookup", "--shortest", "2"])
    assert looked_up.lookup == Lookup(4, 2) and looked_up.merge is None
    assert flags.arguments_of(looked_up)[-6:] == ["--kind", "lookup", "--longest", "4", "--shortest", "2"]


def test_options_of_optional_settings_without_their_switch_are_refused_naming_both() -> None:
    with pytest.raises(flags.FlagError, match="--longest and --shortest apply to --kind lookup and --merge only"):
        service_of(["--model", "m", "--longest", "6"])


def test_optional_settings_named_on_are_built_without_their_switch() -> None:
    args = parser_of(Service, "--kind").parse_args(["--model", "m", "--longest", "6"])
    settings = flags.settings_of(Service, args, on=("lookup", "merge"))
    assert (settings.lookup, settings.merge) == (Lookup(6, 1), Merge(Lookup(6, 3)))


def test_the_help_shows_each_default_and_an_option_s_default_under_each_switch() -> None:
    text = " ".join(parser_of(Service, "--kind").format_help().split())
    assert "--timeout TIMEOUT seconds (default: 2.5)" in text
    assert "shortest suffix (default: 1 with --kind lookup, 3 with --merge)" in text
    assert "--verbose, --no-verbose say more (default: on)" in text


def test_the_flags_of_a_few_fields() -> None:
    assert flags.field_arguments(Service, mode="exact", port=None) == ["--mode", "exact", "--no-port"]
    assert flags.field_arguments(Service, merge=Merge()) == ["--merge", "--longest", "4", "--shortest", "3"]
    assert flags.field_arguments(Service, lookup=None) == []


def test_the_target_s_settings_round_trip_with_their_device_request() -> None:
    target = TargetSettings(
        Path("m"), "bfloat16", "cuda:1", 64, KVCacheSettings(num_blocks=9, attention_backend="flashinfer"), 2, 3
    )
    request = DeviceRequest.of(target.device, target.dtype, target.cache)
    assert request == DeviceRequest("cuda:1", "bfloat16", "flashinfer", False)
    parser = parser_of(TargetSettings)
    flags.add_options(parser, DeviceRequest)
    args = parser.parse_args([*flags.arguments_of(target), *flags.arguments_of(request)])
    assert flags.settings_of(DeviceRequest, args) == request
    cache = flags.settings_of(KVCacheSettings, args, attention_backend=request.attention_backend)
    assert flags.settings_of(TargetSettings, args, dtype="bfloat16", device="cuda:1", cache=cache) == target


def test_the_draft_s_settings_round_trip_and_resolve_their_tree() -> None:
    draft = DraftSettings(Path("d"), "t:1", "draft-7", num_steps=3, tree=TreeShape(4, 0), mtp_feedback="pre_norm")
    assert draft.tree == TreeShape(4, 4)  # 0 draft tokens: steps + 1
    args = parser_of(DraftSettings).parse_args(flags.arguments_of(draft))
    assert flags.settings_of(DraftSettings, args) == draft


def test_the_orchestrator_s_settings_round_trip_with_hybrid_drafts() -> None:
    parser = parser_of(OrchestratorSettings, "--draft")
    args = parser.parse_args(["--target-address", "t:1", "--tokenizer", "tok", "--hybrid-ngram", "--ngram-max", "6"])
    settings = flags.settings_of(OrchestratorSettings, args)
    assert settings.scheduler.hybrid == HybridSettings(NgramSettings(6, 3))
    assert flags.settings_of(OrchestratorSettings, parser.parse_args(flags.arguments_of(settings))) == settings
