"""The `tandem` command: serve, one service per process, a streaming generate client, the memory plan of a target,
and the benchmarks."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from launch.client import add_client_parsers, generate, scale
from launch.plan_command import add_plan_parser
from launch.security_flags import admin_token_of, client_security_of
from launch.serve_command import add_serve_parser, run_serve
from launch.service_commands import add_service_parsers, run_service
from tandem.errors import StartupError
from tandem.serving import configure_logging
from tandem.settings import apply_service_environment

# The commands that get the services' OpenMP environment: the services, and `bench`, whose colocated engine and
# transformers rows compute beside them and are compared with them under the same runtime settings.
SERVICE_ENVIRONMENT_COMMANDS = ("serve", "target", "draft", "orchestrator", "bench")
# The benchmarks parse their own flags (bench.cli): the product imports bench, and psutil, only when one runs.
BENCH_COMMANDS = {
    "bench": "benchmark speculative vs target-only vs colocated",
    "bench-load": "load test: many concurrent streams, a KV pool smaller than them",
    "bench-faults": "faults between the services, one after another under streams: what each costs",
    "bench-profile": "where one request's time goes in each service, by phase (py-spy)",
    "bench-mixed": "a mixed stream (free, JSON schema, penalties) through the HTTP API, each class vs target-only",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_service_parsers(commands)
    for command, summary in BENCH_COMMANDS.items():
        # Listed here; `tandem bench --help` is bench.cli's. No help option of its own, so --help reaches bench.cli.
        commands.add_parser(command, help=summary, add_help=False)
    add_client_parsers(commands)
    add_plan_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in SERVICE_ENVIRONMENT_COMMANDS:
        apply_service_environment()
    if args.command in BENCH_COMMANDS:
        from bench.cli import run_bench_command

        return run_bench_command(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return run_serve(args)
    if args.command == "plan":
        from launch.plan_report import run_plan  # imports torch, which the other commands' parsing does without

        return run_plan(args)
    if args.command == "generate":
        return generate(args)
    if args.command == "scale":
        return scale(args.address, args.draft_replicas, client_security_of(args), admin_token_of(args))
    try:
        configure_logging(args.command)
        run_service(args)
    except StartupError as error:
        logging.getLogger("tandem").error("%s cannot start: %s", args.command, error)
        return 2
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """Ends a service whose servers have stopped: the exit handlers run (weakref finalizers, temporary directories,
    child processes, logging) and the output is flushed, but the interpreter's teardown of every module and object
    is skipped. For a service with torch and gRPC loaded that teardown took 0.5-0.6 s of CPU and up to 0.7 s on every
    stop, for nothing a process that ends has to keep."""
    atexit._run_exitfuncs()  # what sys.exit would run; os._exit runs none of it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
