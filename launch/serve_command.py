"""`tandem serve`: its parser (ServeSettings's options and the few that are no settings field) and its start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.devices import placement_of
from launch.model_dirs import NGRAM, block_drafts, draft_option, model_dir
from launch.processes import serve
from launch.security_flags import add_admin_token_options, add_api_key_options, admin_token_of, api_key_of
from launch.serve_settings import ServeSettings
from launch.stack_security import ServeSecurity
from orchestrator.settings import SchedulerSettings
from tandem import flags
from tandem.devices import DeviceRequest
from tandem.errors import StartupError
from tandem.extras import RAY
from tandem.grpc_util import set_keepalive_timeout
from tandem.settings import DEMO_CHAT_TEMPLATE, DEMO_DRAFT, DEMO_DRAFTS, DEMO_TARGET, KVCacheSettings, log_level

STEPS = flags.dest_of(flags.flag_of(SchedulerSettings, "num_steps")[flags.FLAG].name)  # --speculative-num-steps


def add_serve_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("serve", help="start target, draft and orchestrator on loopback")
    parser.add_argument("--target", type=Path, help="target model directory (Hugging Face); default: the demo pair")
    parser.add_argument(
        "--draft",
        type=draft_option,
        help=f"draft directory, or {' | '.join('demo:' + name for name in DEMO_DRAFTS)}, or ngram (prompt lookup, "
        "no draft model); default: demo:eagle3 with the demo target, else none",
    )
    flags.add_options(parser, ServeSettings)
    # Not given: the draft's own (a block drafter's whole block), else SchedulerSettings's (serve_settings_of).
    parser.set_defaults(**{STEPS: None})
    flags.add_options(parser, DeviceRequest)
    add_api_key_options(parser, "key that Generate calls must carry as 'authorization: Bearer KEY'")
    add_admin_token_options(parser, "bearer token that OrchestratorAdmin calls must carry")


def serve_settings_of(args: argparse.Namespace) -> ServeSettings:
    """The settings of the parsed flags. No --target: the demo pair (with the demo head unless --draft names
    another); a --target of your own gets no draft unless --draft is given, since the demo head fits the demo target
    only. No --speculative-num-steps: a block drafter's B - 1, else SchedulerSettings's default. Raises ValueError
    for flags that do not fit together, StartupError for what the machine cannot do."""
    demo = args.target is None
    draft_dir = _draft_dir(args.draft, demo)
    if getattr(args, STEPS) is None:
        setattr(args, STEPS, block_drafts(draft_dir) or SchedulerSettings.num_steps)
    placement = placement_of(flags.settings_of(DeviceRequest, args), ranks=args.tp)
    security = flags.settings_of(ServeSecurity, args, api_key=api_key_of(args), admin_token=admin_token_of(args))
    return flags.settings_of(
        ServeSettings,
        args,
        target_dir=model_dir(args.target, DEMO_TARGET, "--target"),
        draft_dir=draft_dir,
        dtype=placement.dtype,
        device=placement.device,
        cache=placement.cache(flags.settings_of(KVCacheSettings, args)),
        security=security,
        chat_template=args.chat_template or (DEMO_CHAT_TEMPLATE if demo else None),
    )


def _draft_dir(given: Path | str | None, demo: bool) -> Path | None:
    """The draft model of --draft: none for ngram, the demo head by default with the demo target."""
    if given == NGRAM:
        return None
    if demo:
        return model_dir(given if isinstance(given, Path) else None, DEMO_DRAFT, "--draft")
    return given if isinstance(given, Path) else None


def run_serve(args: argparse.Namespace) -> int:
    """Starts the stack with the launcher the flags name and serves until stopped; returns the exit code."""
    try:
        if args.launcher == "ray":
            RAY.require("--launcher ray")
        log_level()  # refused here, once, rather than by each service it starts
        settings = serve_settings_of(args)
        set_keepalive_timeout(settings.keepalive_timeout_s)
    except StartupError as error:
        print(f"tandem serve cannot start: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None
    if settings.launcher == "ray":
        from launch.ray_cluster import serve_on_ray  # imports ray: only on this path

        return serve_on_ray(settings)
    return serve(settings)
