"""`tandem bench`, `bench-load`, `bench-faults`, `bench-profile` and `bench-mixed`: their flags (their settings'
options, bench-faults's own) and their runs.

`tandem` (launch.cli) lists both commands and hands their arguments here, so that the product's start-up imports no
bench module. Both measure processes with psutil, of the bench extra: without it they stop before anything starts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.kinds import KIND_NAMES, TREE_KIND
from bench.load_settings import LoadSettings
from bench.settings import BenchSettings, MixedSettings, ProfileSettings
from launch.model_dirs import NGRAM, draft_option, model_dir
from tandem import flags
from tandem.extras import BENCH, Extra
from tandem.grpc_util import KEEPALIVE_TIMEOUT_S
from tandem.settings import DEMO_DRAFT, DEMO_TARGET

PSUTIL = Extra(BENCH.name, "psutil")  # bench/cpu.py and bench/memory.py: the processes' CPU time and memory


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem bench", description="benchmark speculative vs target-only vs colocated"
    )
    parser.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    parser.add_argument(
        "--draft", type=draft_option, help="draft directory, demo:<name> or ngram (default: demo:eagle3)"
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KIND_NAMES,
        help="measure these draft kinds side by side, each on a stack of its own: chain, tree (the shape flags', or "
        f"topk {TREE_KIND.topk} with {TREE_KIND.num_draft_tokens} draft tokens), ngram, "
        "hybrid (the --draft model with n-gram drafts merged in), block (the --block-draft block drafter, its whole "
        "block a round)",
    )
    flags.add_options(parser, BenchSettings)
    return parser


def load_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem bench-load", description="load test: many concurrent streams, a KV pool smaller than them"
    )
    parser.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    parser.add_argument("--draft", type=draft_option, help="draft directory or demo:<name> (default: demo:eagle3)")
    flags.add_options(parser, LoadSettings)
    return parser


def faults_parser() -> argparse.ArgumentParser:
    from bench.faults import SCENARIOS  # no torch: the services run in processes of their own

    parser = argparse.ArgumentParser(
        prog="tandem bench-faults",
        description="faults between the services, one after another under 10 streams: what each costs, as a table",
    )
    _add_demo_pair(parser)
    parser.add_argument(
        "--scenarios", nargs="+", choices=list(SCENARIOS), metavar="SCENARIO", help=f"default: all of {list(SCENARIOS)}"
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=flags.keepalive_seconds,
        default=KEEPALIVE_TIMEOUT_S,
        help="every service's --keepalive-timeout; blackholes last twice it, pauses 1.5 times",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/faults"), help="where the report goes")
    return parser


def _add_demo_pair(parser: argparse.ArgumentParser) -> None:
    """--target and --draft as directories, the demo pair by default (bench-faults, bench-profile)."""
    parser.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    parser.add_argument("--draft", type=Path, help="draft directory (default: the demo EAGLE3 head)")


def profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem bench-profile",
        description="where one request's time goes in each service of the split stack, by phase (py-spy samples)",
    )
    _add_demo_pair(parser)
    flags.add_options(parser, ProfileSettings)
    return parser


def mixed_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem bench-mixed",
        description="a mixed stream (free code, JSON schema, penalties) through the HTTP API, each class against its "
        "own target-only speed",
    )
    _add_demo_pair(parser)
    flags.add_options(parser, MixedSettings)
    return parser


def bench_settings_of(args: argparse.Namespace) -> BenchSettings:
    """Raises ValueError for flags that do not fit together."""
    if args.kinds and (args.draft == NGRAM or args.hybrid_ngram or args.address):
        raise ValueError(
            "--kinds names the draft kinds: give their draft model with --draft (not ngram), no --hybrid-ngram (name "
            "the hybrid kind) and no --address (each kind starts its own stack)"
        )
    return flags.settings_of(
        BenchSettings,
        args,
        # With --kinds, --ngram-max and --ngram-min give the lookups of the ngram and hybrid kinds.
        on=("ngram", "hybrid") if args.kinds else (),
        target_dir=model_dir(args.target, DEMO_TARGET, "--target"),
        draft_dir=None if args.draft == NGRAM else model_dir(args.draft, DEMO_DRAFT, "--draft"),
        kinds=tuple(args.kinds or ()),
    )


def load_settings_of(args: argparse.Namespace) -> LoadSettings:
    if args.draft == NGRAM:
        # The load test checks every draft replica's KV pool; the n-gram drafter has none and no address.
        raise ValueError("--draft ngram is not supported; give a draft directory or demo:<name>")
    return flags.settings_of(
        LoadSettings,
        args,
        target_dir=model_dir(args.target, DEMO_TARGET, "--target"),
        draft_dir=model_dir(args.draft, DEMO_DRAFT, "--draft"),
    )


def run_bench_command(command: str, arguments: Sequence[str]) -> int:
    """Runs `tandem bench`, `tandem bench-load` or `tandem bench-faults` with their arguments; returns the exit
    code."""
    if command == "bench-faults":
        return _run_faults(faults_parser().parse_args(arguments))
    if command == "bench-profile":
        return _run_profile(profile_parser().parse_args(arguments))
    if command == "bench-mixed":
        return _run_mixed(mixed_parser().parse_args(arguments))
    args = (bench_parser() if command == "bench" else load_parser()).parse_args(arguments)
    missing = PSUTIL.missing()
    if missing is not None:
        print(f"tandem {command} cannot start: {missing}", file=sys.stderr)
        return 2
    try:
        settings = bench_settings_of(args) if command == "bench" else load_settings_of(args)
    except ValueError as error:
        raise SystemExit(f"tandem {command}: {error}") from None
    if isinstance(settings, BenchSettings):
        from bench.main import run_benchmark

        print(run_benchmark(settings).read_text())
        return 0
    return _run_load(settings)


def _run_load(settings: LoadSettings) -> int:
    """Runs the load test; exits non-zero on a timeout, a failed stream or KV blocks missing at the end."""
    from bench.load import LoadTimeout, run_load

    try:
        report, run = run_load(settings)
    except (ValueError, LoadTimeout) as error:
        raise SystemExit(f"tandem bench-load: {error}") from None
    print(report.read_text())
    failures = [f"{count} streams failed with {code}" for code, count in sorted(run.errors.items())]
    failures += [] if run.kv_back else ["KV blocks did not all come back"]
    if failures:
        print(f"tandem bench-load: {'; '.join(failures)} (see {report})", file=sys.stderr)
        return 1
    return 0


def _run_faults(args: argparse.Namespace) -> int:
    """Runs the fault scenarios; exits non-zero when one lost, held or broke anything (bench.faults.lost)."""
    from bench.faults import SCENARIOS, lost, run_faults, write_report

    target = model_dir(args.target, DEMO_TARGET, "--target")
    draft = model_dir(args.draft, DEMO_DRAFT, "--draft")
    run = run_faults(target, draft, args.keepalive_timeout, args.scenarios or list(SCENARIOS))
    report = write_report(run, args.out)
    print(report.read_text())
    failures = [f"{r.scenario}: {', '.join(lost(r))}" for r in run.records if lost(r)]
    for failure in failures:
        print(f"tandem bench-faults: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _run_profile(args: argparse.Namespace) -> int:
    if shutil.which("py-spy") is None:
        missing = "py-spy is not installed (pip install 'tandem[bench]')"
        print(f"tandem bench-profile cannot start: {missing}", file=sys.stderr)
        return 2
    from bench.profile import main

    return _print_report(main, ProfileSettings, args)


def _run_mixed(args: argparse.Namespace) -> int:
    missing = Extra(BENCH.name, "openai").missing()
    if missing is not None:
        print(f"tandem bench-mixed cannot start: {missing}", file=sys.stderr)
        return 2
    from bench.mixed import main

    return _print_report(main, MixedSettings, args)


def _print_report(main: Callable[[Any], Path], settings: type[Any], args: argparse.Namespace) -> int:
    """Runs a bench command's `main` on its settings (the demo pair unless --target and --draft name others) and
    prints the report it wrote."""
    target = model_dir(args.target, DEMO_TARGET, "--target")
    draft = model_dir(args.draft, DEMO_DRAFT, "--draft")
    print(main(flags.settings_of(settings, args, target_dir=target, draft_dir=draft)).read_text())
    return 0
