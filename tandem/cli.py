"""The `tandem` command: serve, one service per process, and a streaming generate client."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.settings import BenchSettings
from draft_server.settings import MTP_FEEDBACKS, MTP_MODES, DraftSettings
from orchestrator.settings import OrchestratorSettings, SchedulerSettings
from tandem.errors import StartupError
from tandem.launcher import ServeSettings, serve
from tandem.models.aux_layers import CONVENTIONS
from tandem.serving import ListenSettings, configure_logging
from tandem.settings import DEMO_DRAFT, DEMO_DRAFTS, DEMO_TARGET, KVCacheSettings, apply_service_environment
from target_server.settings import TargetSettings

DTYPES = ("float32", "bfloat16", "float16")
LAUNCHERS = ("process", "ray")
SERVICE_COMMANDS = ("serve", "target", "draft", "orchestrator")


def _add_listen(parser: argparse.ArgumentParser, default_port: int = ListenSettings.port) -> None:
    parser.add_argument("--host", default=ListenSettings.host)
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, help="write the bound host:port here once serving")


def _listen(args: argparse.Namespace) -> ListenSettings:
    return ListenSettings(host=args.host, port=args.port, ready_file=args.ready_file)


def _model_dir(given: Path | None, demo: Path, flag: str) -> Path:
    if given is not None:
        return given
    if not (demo / "config.json").is_file():
        raise SystemExit(f"tandem: no {flag} given and the bundled demo pair is not installed at {demo}")
    return demo


def _add_mtp_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mtp-feedback",
        choices=MTP_FEEDBACKS,
        default=DraftSettings.mtp_feedback,
        help="DeepSeek NextN drafts: what one step hands to the next (SGLang: post_norm, vLLM: pre_norm)",
    )
    parser.add_argument(
        "--mtp-mode",
        choices=MTP_MODES,
        default=DraftSettings.mtp_mode,
        help="multi-layer MTP drafts: layer k reads layer k-1's output (chain) or the target's hidden",
    )


def _threads(text: str) -> int:
    count = int(text)
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count}: a thread count is 0 (the default) or more")
    return count


def _add_threads(parser: argparse.ArgumentParser, whose: str, default: str, flag: str = "--threads") -> None:
    parser.add_argument(flag, type=_threads, default=0, help=f"intra-op (OpenMP) threads of {whose} model; {default}")


def _draft_dir(given: str) -> Path:
    """A draft directory, or `demo:<name>` for one of the bundled demo heads (which fit the demo target only)."""
    if not given.startswith("demo:"):
        return Path(given)
    name = given.removeprefix("demo:")
    if name not in DEMO_DRAFTS:
        raise argparse.ArgumentTypeError(f"{given!r}: the demo heads are {', '.join('demo:' + n for n in DEMO_DRAFTS)}")
    return DEMO_DRAFTS[name]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def _add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-num-seqs", type=_positive, default=SchedulerSettings.max_num_seqs, help="requests running at once"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=SchedulerSettings.max_num_batched_tokens,
        help="tokens one target step computes: verification rows first, then prompt chunks",
    )
    parser.add_argument(
        "--max-waiting", type=_positive, default=SchedulerSettings.max_waiting, help="queued requests before refusing"
    )


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-blocks", type=_positive, default=KVCacheSettings.num_blocks, help="KV blocks preallocated in the pool"
    )
    parser.add_argument("--block-size", type=_positive, default=KVCacheSettings.block_size, help="tokens per KV block")


def _cache(args: argparse.Namespace) -> KVCacheSettings:
    return KVCacheSettings(num_blocks=args.kv_blocks, block_size=args.block_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="start target, draft and orchestrator on loopback")
    serve_parser.add_argument(
        "--target", type=Path, help="target model directory (Hugging Face); default: the bundled demo pair"
    )
    serve_parser.add_argument(
        "--draft",
        type=_draft_dir,
        help="draft directory, or demo:eagle3 | demo:eagle3-mla | demo:mtp; default: demo:eagle3 with the demo "
        "target, else none",
    )
    serve_parser.add_argument("--host", default=ServeSettings.host)
    serve_parser.add_argument("--port", type=int, default=ServeSettings.port)
    serve_parser.add_argument("--speculative-num-steps", type=int, default=ServeSettings.num_steps)
    serve_parser.add_argument("--draft-replicas", type=int, default=ServeSettings.draft_replicas)
    serve_parser.add_argument("--aux-layer-convention", choices=CONVENTIONS, default=ServeSettings.aux_layer_convention)
    serve_parser.add_argument("--dtype", choices=DTYPES, default=ServeSettings.dtype)
    _add_scheduler_options(serve_parser)
    _add_cache_options(serve_parser)
    serve_parser.add_argument(
        "--launcher", choices=LAUNCHERS, default=ServeSettings.launcher, help="child processes, or Ray actors"
    )
    serve_parser.add_argument("--ray-address", help="Ray cluster to join (with --launcher ray); default: a local one")
    serve_parser.add_argument("--tp", type=int, default=ServeSettings.tp, help="the target's tensor-parallel ranks")
    _add_threads(serve_parser, "each target rank's", "0: the cores, over --tp", "--target-threads")
    _add_threads(serve_parser, "each draft replica's", "0: the cores", "--draft-threads")
    _add_mtp_options(serve_parser)

    target_parser = commands.add_parser("target", help="run the target service")
    target_parser.add_argument("--model", type=Path, required=True)
    target_parser.add_argument("--dtype", choices=DTYPES, default=TargetSettings.dtype)
    target_parser.add_argument("--max-context", type=int, default=TargetSettings.max_context)
    _add_cache_options(target_parser)
    target_parser.add_argument("--tp", type=int, default=TargetSettings.tp, help="tensor-parallel ranks")
    _add_threads(target_parser, "each rank's", "0: the cores this process may use, over --tp")
    _add_listen(target_parser)

    draft_parser = commands.add_parser("draft", help="run one draft replica")
    draft_parser.add_argument("--model", type=Path, required=True)
    draft_parser.add_argument("--target-address", required=True)
    draft_parser.add_argument("--replica-id", default=f"draft-{socket.gethostname()}-{os.getpid()}")
    draft_parser.add_argument("--speculative-num-steps", type=int, default=DraftSettings.num_steps)
    draft_parser.add_argument("--aux-layer-convention", choices=CONVENTIONS, default=DraftSettings.aux_layer_convention)
    draft_parser.add_argument("--dtype", choices=DTYPES, default=DraftSettings.dtype)
    _add_cache_options(draft_parser)
    _add_threads(draft_parser, "the draft model's", "0: the cores this process may use")
    _add_mtp_options(draft_parser)
    _add_listen(draft_parser)

    orchestrator_parser = commands.add_parser("orchestrator", help="run the public orchestrator service")
    orchestrator_parser.add_argument("--target-address", required=True)
    orchestrator_parser.add_argument("--draft-address", action="append", default=[], help="repeat per replica")
    orchestrator_parser.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer files")
    orchestrator_parser.add_argument("--speculative-num-steps", type=int, default=SchedulerSettings.num_steps)
    _add_scheduler_options(orchestrator_parser)
    orchestrator_parser.add_argument(
        "--target-timeout", type=float, default=SchedulerSettings.target_timeout_s, help="seconds per target step"
    )
    orchestrator_parser.add_argument(
        "--draft-timeout", type=float, default=SchedulerSettings.draft_timeout_s, help="seconds per Propose"
    )
    orchestrator_parser.add_argument(
        "--default-max-new-tokens", type=int, default=OrchestratorSettings.default_max_new_tokens
    )
    orchestrator_parser.add_argument("--scaler-address", help="the launcher that starts and stops draft replicas")
    _add_listen(orchestrator_parser, default_port=ServeSettings.port)

    bench_parser = commands.add_parser("bench", help="benchmark speculative vs target-only vs colocated")
    bench_parser.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    bench_parser.add_argument("--draft", type=_draft_dir, help="draft directory or demo:<name> (default: demo:eagle3)")
    bench_parser.add_argument("--address", help="a running stack to measure (default: start one)")
    bench_parser.add_argument("--num-prompts", type=int, default=BenchSettings.num_prompts)
    bench_parser.add_argument("--max-new-tokens", type=int, default=BenchSettings.max_new_tokens)
    bench_parser.add_argument("--concurrency", type=int, nargs="+", default=list(BenchSettings.concurrency))
    bench_parser.add_argument("--speculative-num-steps", type=int, default=BenchSettings.num_steps)
    bench_parser.add_argument("--draft-replicas", type=int, default=BenchSettings.draft_replicas)
    bench_parser.add_argument("--dtype", choices=DTYPES, default=BenchSettings.dtype, help="of target and draft")
    _add_threads(bench_parser, "the started stack's target", "0: tandem serve's default", "--target-threads")
    _add_threads(bench_parser, "the started stack's draft", "0: tandem serve's default", "--draft-threads")
    bench_parser.add_argument(
        "--repeats", type=int, default=BenchSettings.repeats, help="runs of each configuration; medians are reported"
    )
    bench_parser.add_argument("--no-colocated", action="store_true", help="skip the one-process baseline")
    bench_parser.add_argument("--out", type=Path, default=BenchSettings.out_dir)

    scale_parser = commands.add_parser("scale", help="change the number of draft replicas of a running stack")
    scale_parser.add_argument("--draft-replicas", type=int, required=True)
    scale_parser.add_argument("--address", default=f"127.0.0.1:{ServeSettings.port}")

    generate_parser = commands.add_parser("generate", help="stream a completion from a running Tandem")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("--address", default=f"127.0.0.1:{ServeSettings.port}")
    generate_parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the server default")
    generate_parser.add_argument("--temperature", type=float, default=0.0)
    generate_parser.add_argument("--top-p", type=float, default=0.0, help="0: no nucleus filtering")
    generate_parser.add_argument("--top-k", type=int, default=0)
    generate_parser.add_argument("--seed", type=int, default=0)
    generate_parser.add_argument("--stop", action="append", default=[])
    generate_parser.add_argument("--ignore-eos", action="store_true")
    generate_parser.add_argument("--no-speculation", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in SERVICE_COMMANDS:
        apply_service_environment()
    if args.command == "serve":
        # No --target: the demo pair (with the demo head unless --draft names another). A --target of
        # your own gets no draft unless --draft is given: the demo head only fits the demo target.
        target_dir = _model_dir(args.target, DEMO_TARGET, "--target")
        draft_dir = args.draft if args.target is not None else _model_dir(args.draft, DEMO_DRAFT, "--draft")
        if args.ray_address is not None and args.launcher != "ray":
            raise SystemExit("tandem: --ray-address needs --launcher ray")
        settings = ServeSettings(
            target_dir=target_dir,
            draft_dir=draft_dir,
            draft_replicas=args.draft_replicas,
            host=args.host,
            port=args.port,
            num_steps=args.speculative_num_steps,
            aux_layer_convention=args.aux_layer_convention,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            cache=_cache(args),
            launcher=args.launcher,
            ray_address=args.ray_address,
            tp=args.tp,
            target_threads=args.target_threads,
            draft_threads=args.draft_threads,
            mtp_feedback=args.mtp_feedback,
            mtp_mode=args.mtp_mode,
        )
        if settings.launcher == "ray":
            from tandem.ray_launcher import serve_on_ray  # imports ray: only on this path

            return serve_on_ray(settings)
        return serve(settings)
    if args.command == "bench":
        from bench.main import run_benchmark

        if args.repeats < 1:
            raise SystemExit(f"tandem: --repeats must be at least 1, got {args.repeats}")
        bench = BenchSettings(
            target_dir=_model_dir(args.target, DEMO_TARGET, "--target"),
            draft_dir=_model_dir(args.draft, DEMO_DRAFT, "--draft"),
            address=args.address,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            concurrency=tuple(args.concurrency),
            num_steps=args.speculative_num_steps,
            draft_replicas=args.draft_replicas,
            dtype=args.dtype,
            target_threads=args.target_threads,
            draft_threads=args.draft_threads,
            repeats=args.repeats,
            colocated=not args.no_colocated,
            out_dir=args.out,
        )
        print(run_benchmark(bench).read_text())
        return 0
    if args.command == "generate":
        from tandem.client import generate

        return generate(args)
    if args.command == "scale":
        from tandem.client import scale

        return scale(args.address, args.draft_replicas)
    configure_logging(args.command)
    try:
        run_service(args)
    except StartupError as error:
        logging.getLogger("tandem").error("%s cannot start: %s", args.command, error)
        return 2
    return 0


def run_service(args: argparse.Namespace) -> None:
    """Runs one service process until it is stopped."""
    if args.command == "target":
        from target_server.main import serve_target

        target = TargetSettings(
            model_dir=args.model,
            dtype=args.dtype,
            max_context=args.max_context,
            cache=_cache(args),
            tp=args.tp,
            threads=args.threads,
        )
        asyncio.run(serve_target(target, _listen(args)))
    elif args.command == "draft":
        from draft_server.main import serve_draft

        draft = DraftSettings(
            model_dir=args.model,
            target_address=args.target_address,
            replica_id=args.replica_id,
            num_steps=args.speculative_num_steps,
            aux_layer_convention=args.aux_layer_convention,
            cache=_cache(args),
            dtype=args.dtype,
            threads=args.threads,
            mtp_feedback=args.mtp_feedback,
            mtp_mode=args.mtp_mode,
        )
        asyncio.run(serve_draft(draft, _listen(args)))
    elif args.command == "orchestrator":
        from orchestrator.main import serve_orchestrator

        orchestrator = OrchestratorSettings(
            target_address=args.target_address,
            draft_addresses=tuple(args.draft_address),
            tokenizer_dir=args.tokenizer,
            scheduler=SchedulerSettings(
                num_steps=args.speculative_num_steps,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_waiting=args.max_waiting,
                target_timeout_s=args.target_timeout,
                draft_timeout_s=args.draft_timeout,
            ),
            default_max_new_tokens=args.default_max_new_tokens,
            scaler_address=args.scaler_address,
        )
        asyncio.run(serve_orchestrator(orchestrator, _listen(args)))


if __name__ == "__main__":
    sys.exit(main())
