"""The `tandem` command: serve, one service per process, and a streaming generate client."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.kinds import KIND_NAMES, TREE_KIND
from bench.load_settings import LoadSettings
from bench.settings import BenchSettings
from draft_server.settings import MTP_FEEDBACKS, MTP_MODES, DraftSettings
from launch.devices import Placement, add_device_options, placement_of
from launch.processes import ServeSettings, serve
from launch.security_flags import (
    add_admin_options,
    add_admin_token_options,
    add_api_key_options,
    add_tls_options,
    admin_settings_of,
    admin_token_of,
    api_key_of,
    client_security_of,
    internal_security_of,
    public_security_of,
)
from launch.stack_security import ServeSecurity
from orchestrator.settings import (
    AdminSettings,
    DiscoverySettings,
    HttpSettings,
    HybridSettings,
    NgramSettings,
    OrchestratorSettings,
    SchedulerSettings,
    parse_host_port,
)
from tandem.devices import DTYPES
from tandem.errors import StartupError
from tandem.extras import RAY
from tandem.models.aux_layers import CONVENTIONS
from tandem.serving import ListenSettings, configure_logging
from tandem.settings import (
    DEMO_CHAT_TEMPLATE,
    DEMO_DRAFT,
    DEMO_DRAFTS,
    DEMO_TARGET,
    KVCacheSettings,
    TreeShape,
    apply_service_environment,
    parse_size,
)
from tandem.transport import Insecure, TransportSecurity
from target_server.settings import TargetSettings

LAUNCHERS = ("process", "ray")
# The commands that get the services' OpenMP environment: the services, and `bench`, whose colocated engine and
# transformers rows compute beside them and are compared with them under the same runtime settings.
SERVICE_ENVIRONMENT_COMMANDS = ("serve", "target", "draft", "orchestrator", "bench")
NGRAM = "ngram"  # --draft ngram: prompt-lookup drafting in the orchestrator, no draft model (orchestrator/ngram.py)


def _add_listen(parser: argparse.ArgumentParser, default_port: int = ListenSettings.port) -> None:
    parser.add_argument("--host", default=ListenSettings.host)
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, help="write the bound host:port here once serving")


def _add_metrics_port(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help=f"serve {whose} Prometheus /metrics on this port, on --host (0: a free one; unset: none)",
    )


def _listen(args: argparse.Namespace, security: TransportSecurity) -> ListenSettings:
    return ListenSettings(host=args.host, port=args.port, ready_file=args.ready_file, security=security)


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


def _draft(given: str) -> Path | str:
    """`--draft`: a draft directory or `demo:<name>` (_draft_dir), or NGRAM (a directory of that name: ./ngram)."""
    return NGRAM if given == NGRAM else _draft_dir(given)


def _add_ngram_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hybrid-ngram",
        action="store_true",
        help="merge the prompt-lookup proposal into every draft model's answer as one more branch "
        "(--ngram-max / --ngram-min apply)",
    )
    hybrid = HybridSettings().ngram
    parser.add_argument(
        "--ngram-max",
        type=_positive,
        help=f"--draft ngram and --hybrid-ngram: the longest suffix looked up, tried first (default "
        f"{NgramSettings.max_n}; {hybrid.max_n} with --hybrid-ngram)",
    )
    parser.add_argument(
        "--ngram-min",
        type=_positive,
        help=f"--draft ngram and --hybrid-ngram: the shortest suffix looked up (default {NgramSettings.min_n}; "
        f"{hybrid.min_n} with --hybrid-ngram)",
    )


def _ngram_lengths(args: argparse.Namespace, defaults: NgramSettings) -> NgramSettings:
    """`defaults` with the suffix lengths the flags give."""
    given = {name: value for name, value in (("max_n", args.ngram_max), ("min_n", args.ngram_min)) if value is not None}
    try:
        return dataclasses.replace(defaults, **given)
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None


def _ngram(args: argparse.Namespace) -> NgramSettings | None:
    """The n-gram drafter's settings for `--draft ngram`; None for any other draft."""
    if args.draft != NGRAM:
        if (args.ngram_max is not None or args.ngram_min is not None) and not args.hybrid_ngram:
            raise SystemExit("tandem: --ngram-max and --ngram-min apply to --draft ngram and --hybrid-ngram only")
        return None
    if args.hybrid_ngram:
        raise SystemExit("tandem: --hybrid-ngram merges n-gram drafts into a draft model's; --draft ngram has none")
    return _ngram_lengths(args, NgramSettings())


def _hybrid(args: argparse.Namespace) -> HybridSettings | None:
    """The settings of `--hybrid-ngram`; None without it."""
    return _hybrid_settings(args) if args.hybrid_ngram else None


def _hybrid_settings(args: argparse.Namespace) -> HybridSettings:
    defaults = HybridSettings()
    return dataclasses.replace(defaults, ngram=_ngram_lengths(args, defaults.ngram))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be 0 or more")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a number of seconds above 0")
    return value


def _host_port(text: str) -> tuple[str, int]:
    try:
        return parse_host_port(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _discovery(args: argparse.Namespace) -> DiscoverySettings | None:
    if args.tls_server_name is not None:
        if args.draft_dns is None:
            raise SystemExit(
                "tandem: --tls-server-name names the certificate of replicas found by --draft-dns; give it"
            )
        if args.tls_ca is None:
            raise SystemExit("tandem: --tls-server-name needs --tls-ca: without it no certificate is checked")
    if args.draft_dns is None:
        return None
    host, port = args.draft_dns
    return DiscoverySettings(
        host=host, port=port, interval_s=args.draft_dns_interval, tls_server_name=args.tls_server_name
    )


def _add_tree_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=TreeShape.topk,
        help="tree drafting: branches per node of an EAGLE3 head's draft tree; 1: a chain",
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=TreeShape.num_draft_tokens,
        help="tree drafting: nodes of the tree plus one (the last committed token); 0: --speculative-num-steps + 1, "
        "which topk 1 requires",
    )


def tree_shape_of(args: argparse.Namespace) -> TreeShape:
    """The tree shape of the flags, checked against --speculative-num-steps."""
    try:
        return TreeShape(args.speculative_eagle_topk, args.speculative_num_draft_tokens).resolved(
            args.speculative_num_steps
        )
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None


def _add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=SchedulerSettings.adaptive_k,
        help="choose k (0 included) per batch from measured round costs and acceptance, at most "
        "--speculative-num-steps; at k = 0 a batch's requests decode target-only (default: on; --no-adaptive-k "
        "always drafts --speculative-num-steps tokens)",
    )
    parser.add_argument(
        "--draft-ahead",
        type=_non_negative,
        default=SchedulerSettings.draft_ahead,
        metavar="N",
        help="in steps with at most N drafting requests, draft replicas draft a request's next round as soon as the "
        f"target's hidden rows reach them, before the orchestrator asks (default {SchedulerSettings.draft_ahead}; "
        "0: only when asked)",
    )
    parser.add_argument(
        "--push-drafts",
        action=argparse.BooleanOptionalAction,
        default=SchedulerSettings.push_drafts,
        help="replicas send the drafts they made ahead (--draft-ahead) straight to the target, which verifies them "
        "when the orchestrator's next step says so; --no-push-drafts: the orchestrator fetches them (Propose) and "
        "carries them to the target",
    )
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
    parser.add_argument(
        "--num-scheduler-steps",
        type=_positive,
        default=SchedulerSettings.num_scheduler_steps,
        help="forward passes one target step may run when its requests decode without drafts and nothing else "
        "waits (1: one token per step)",
    )
    parser.add_argument(
        "--target-timeout", type=float, default=SchedulerSettings.target_timeout_s, help="seconds per target step"
    )
    parser.add_argument(
        "--draft-timeout", type=float, default=SchedulerSettings.draft_timeout_s, help="seconds per Propose"
    )


def scheduler_settings_of(args: argparse.Namespace) -> SchedulerSettings:
    """The orchestrator's scheduler settings from the flags _add_scheduler_options and _add_tree_options add."""
    return SchedulerSettings(
        num_steps=args.speculative_num_steps,
        tree=tree_shape_of(args),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        num_scheduler_steps=args.num_scheduler_steps,
        adaptive_k=args.adaptive_k,
        draft_ahead=args.draft_ahead,
        push_drafts=args.push_drafts,
        hybrid=_hybrid(args),
        target_timeout_s=args.target_timeout,
        draft_timeout_s=args.draft_timeout,
    )


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument(
        "--kv-blocks",
        type=_positive,
        default=KVCacheSettings.num_blocks,
        help=f"KV blocks preallocated in the pool (default {KVCacheSettings.num_blocks})",
    )
    pool.add_argument(
        "--kv-cache-memory",
        type=_size,
        default=KVCacheSettings.memory_bytes,
        help="size the KV pool by memory instead of blocks, e.g. 512MiB or 4GiB (per process: target rank, draft)",
    )
    parser.add_argument("--block-size", type=_positive, default=KVCacheSettings.block_size, help="tokens per KV block")
    parser.add_argument(
        "--orphan-timeout",
        type=float,
        default=KVCacheSettings.orphan_timeout_s,
        help="seconds after which the requests of an orchestrator that went away are freed",
    )


def _cache(args: argparse.Namespace, placement: Placement) -> KVCacheSettings:
    return KVCacheSettings(
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        memory_bytes=args.kv_cache_memory,
        orphan_timeout_s=args.orphan_timeout,
        attention_backend=placement.attention_backend,
        cuda_graphs=placement.cuda_graphs,
    )


def _serve_security(args: argparse.Namespace) -> ServeSecurity:
    security = ServeSecurity(
        api_key=api_key_of(args),
        admin_port=args.admin_port,
        admin_token=admin_token_of(args),
        max_draft_replicas=args.max_draft_replicas,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        internal_tls=args.internal_tls,
        tls_server_name=args.tls_server_name,
    )
    try:
        security.check()
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None
    if args.draft_replicas > security.max_draft_replicas:
        raise SystemExit(f"tandem: --draft-replicas {args.draft_replicas} is above --max-draft-replicas")
    if security.tls_server_name is not None and args.launcher != "ray":
        raise SystemExit(
            "tandem: --tls-server-name needs --launcher ray: the process launcher's services are on loopback, "
            "where the certificate names 127.0.0.1"
        )
    return security


def _add_http_options(parser: argparse.ArgumentParser, serve: bool) -> None:
    """The orchestrator's OpenAI-compatible HTTP API and /metrics: on by default for serve, off for orchestrator."""
    http = parser.add_mutually_exclusive_group()
    if serve:
        http.add_argument(
            "--http-port",
            type=int,
            default=ServeSettings.http_port,
            help="port of the OpenAI-compatible HTTP API and /metrics, HTTPS when the public port serves TLS "
            "(default: a free port, printed)",
        )
        http.add_argument("--no-http", action="store_true", help="serve gRPC only")
    else:
        http.add_argument(
            "--http-port",
            type=int,
            help="serve the OpenAI-compatible HTTP API and /metrics here (0: free), HTTPS with --tls-cert/--tls-key "
            "unless --public-plaintext",
        )
        parser.add_argument("--http-ready-file", type=Path, help="write the HTTP API's URL here once it listens")
    parser.add_argument(
        "--chat-template",
        type=Path,
        help="Jinja chat template for /v1/chat/completions when the tokenizer has none (demo target: bundled)",
    )
    parser.add_argument("--served-model-name", help="the model's name in the HTTP API and metrics (default: its dir)")


def _add_load_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    load = commands.add_parser("bench-load", help="load test: many concurrent streams, a KV pool smaller than them")
    load.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    load.add_argument("--draft", type=_draft, help="draft directory or demo:<name> (default: demo:eagle3)")
    load.add_argument("--streams", type=int, default=LoadSettings.streams, help="streams opened at once")
    for flag, default, what in (
        ("--prompt-tokens", LoadSettings.prompt_tokens, "prompt length"),
        ("--max-new-tokens", LoadSettings.new_tokens, "token budget"),
    ):
        load.add_argument(
            flag, type=int, nargs=2, metavar=("MIN", "MAX"), default=list(default), help=f"each stream's {what}"
        )
    load.add_argument("--kv-blocks", type=int, default=LoadSettings.kv_blocks, help="KV pool of target and draft")
    load.add_argument(
        "--timeout", type=float, default=LoadSettings.timeout_s, help="seconds for all streams to finish (then fail)"
    )
    load.add_argument("--output-dir", type=Path, default=LoadSettings.out_dir, help="for latest.json and latest.md")


def _bench_load(args: argparse.Namespace) -> int:
    """Runs the load test; exits non-zero on a timeout, a failed stream or KV blocks missing at the end."""
    from bench.load import LoadTimeout, run_load

    if args.draft == NGRAM:
        # The load test checks every draft replica's KV pool; the n-gram drafter has none and no address.
        raise SystemExit("tandem bench-load: --draft ngram is not supported; give a draft directory or demo:<name>")
    settings = LoadSettings(
        target_dir=_model_dir(args.target, DEMO_TARGET, "--target"),
        draft_dir=_model_dir(args.draft, DEMO_DRAFT, "--draft"),
        streams=args.streams,
        prompt_tokens=(args.prompt_tokens[0], args.prompt_tokens[1]),
        new_tokens=(args.max_new_tokens[0], args.max_new_tokens[1]),
        kv_blocks=args.kv_blocks,
        timeout_s=args.timeout,
        out_dir=args.output_dir,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="start target, draft and orchestrator on loopback")
    serve_parser.add_argument(
        "--target", type=Path, help="target model directory (Hugging Face); default: the bundled demo pair"
    )
    serve_parser.add_argument(
        "--draft",
        type=_draft,
        help="draft directory, or demo:eagle3 | demo:eagle3-mla | demo:mtp, or ngram (prompt lookup, no draft "
        "model); default: demo:eagle3 with the demo target, else none",
    )
    _add_ngram_options(serve_parser)
    serve_parser.add_argument("--host", default=ServeSettings.host)
    serve_parser.add_argument("--port", type=int, default=ServeSettings.port)
    serve_parser.add_argument("--speculative-num-steps", type=int, default=SchedulerSettings.num_steps)
    _add_tree_options(serve_parser)
    serve_parser.add_argument("--draft-replicas", type=int, default=ServeSettings.draft_replicas)
    serve_parser.add_argument("--aux-layer-convention", choices=CONVENTIONS, default=ServeSettings.aux_layer_convention)
    add_device_options(serve_parser, "the target and each draft replica")
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
    _add_http_options(serve_parser, serve=True)
    add_api_key_options(serve_parser, "key that Generate calls must carry as 'authorization: Bearer KEY'")
    add_admin_options(serve_parser, with_listen=False)
    add_tls_options(serve_parser, "of every service and the public port (needs all three --tls-* flags)")
    serve_parser.add_argument(
        "--internal-tls",
        action="store_true",
        help="encrypt the services' own traffic with a throwaway CA (mutual TLS); the public port stays plaintext",
    )
    serve_parser.add_argument(
        "--tls-server-name",
        default=ServeSecurity.tls_server_name,
        help="with --launcher ray and --tls-cert: check the services' certificates for NAME instead of the address "
        "dialled (on several machines services bind their node's address)",
    )

    target_parser = commands.add_parser("target", help="run the target service")
    target_parser.add_argument("--model", type=Path, required=True)
    add_device_options(target_parser, "the target (rank r of --tp: GPU N + r)")
    target_parser.add_argument("--max-context", type=int, default=TargetSettings.max_context)
    _add_cache_options(target_parser)
    target_parser.add_argument("--tp", type=int, default=TargetSettings.tp, help="tensor-parallel ranks")
    _add_threads(target_parser, "each rank's", "0: the cores this process may use, over --tp")
    _add_listen(target_parser)
    _add_metrics_port(target_parser, "the target's")
    add_tls_options(target_parser, "of this service")

    draft_parser = commands.add_parser("draft", help="run one draft replica")
    draft_parser.add_argument("--model", type=Path, required=True)
    draft_parser.add_argument("--target-address", required=True)
    draft_parser.add_argument("--replica-id", default=f"draft-{socket.gethostname()}-{os.getpid()}")
    draft_parser.add_argument("--speculative-num-steps", type=int, default=DraftSettings.num_steps)
    _add_tree_options(draft_parser)
    draft_parser.add_argument("--aux-layer-convention", choices=CONVENTIONS, default=DraftSettings.aux_layer_convention)
    add_device_options(draft_parser, "the draft model")
    _add_cache_options(draft_parser)
    _add_threads(draft_parser, "the draft model's", "0: the cores this process may use")
    _add_mtp_options(draft_parser)
    _add_listen(draft_parser)
    _add_metrics_port(draft_parser, "the draft's")
    add_tls_options(draft_parser, "of this service, also presented to the target")

    orchestrator_parser = commands.add_parser("orchestrator", help="run the public orchestrator service")
    orchestrator_parser.add_argument("--target-address", required=True)
    orchestrator_parser.add_argument("--draft-address", action="append", default=[], help="repeat per replica")
    orchestrator_parser.add_argument(
        "--draft", choices=[NGRAM], help="ngram: draft here by prompt lookup, with no draft replicas"
    )
    _add_ngram_options(orchestrator_parser)
    orchestrator_parser.add_argument(
        "--draft-dns",
        type=_host_port,
        help="HOST:PORT: follow the addresses HOST resolves to as draft replicas (a Kubernetes headless Service)",
    )
    orchestrator_parser.add_argument(
        "--draft-dns-interval",
        type=_positive_seconds,
        default=DiscoverySettings.interval_s,
        help="seconds between resolutions of --draft-dns",
    )
    orchestrator_parser.add_argument(
        "--tls-server-name",
        help="with TLS: the name the certificates of replicas found by --draft-dns must hold (they are dialled by IP "
        "address; e.g. the headless Service's name); default: the address dialled",
    )
    orchestrator_parser.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer files")
    orchestrator_parser.add_argument("--speculative-num-steps", type=int, default=SchedulerSettings.num_steps)
    _add_tree_options(orchestrator_parser)
    _add_scheduler_options(orchestrator_parser)
    orchestrator_parser.add_argument(
        "--default-max-new-tokens", type=int, default=OrchestratorSettings.default_max_new_tokens
    )
    orchestrator_parser.add_argument(
        "--max-request-bytes",
        type=_size,
        default=OrchestratorSettings.max_request_bytes,
        help="largest Generate request message accepted, e.g. 4MiB (larger: RESOURCE_EXHAUSTED)",
    )
    orchestrator_parser.add_argument("--scaler-address", help="the launcher that starts and stops draft replicas")
    _add_http_options(orchestrator_parser, serve=False)
    _add_listen(orchestrator_parser, default_port=ServeSettings.port)
    add_api_key_options(orchestrator_parser, "key that Generate calls must carry as 'authorization: Bearer KEY'")
    add_admin_options(orchestrator_parser, with_listen=True)
    add_tls_options(orchestrator_parser, "of the public port, and presented to target and drafts")
    orchestrator_parser.add_argument(
        "--public-plaintext",
        action="store_true",
        help="serve the public and admin ports without TLS even with --tls-cert (certificates only the stack trusts)",
    )

    bench_parser = commands.add_parser("bench", help="benchmark speculative vs target-only vs colocated")
    bench_parser.add_argument("--target", type=Path, help="target directory (default: the demo target)")
    bench_parser.add_argument(
        "--draft", type=_draft, help="draft directory, demo:<name> or ngram (default: demo:eagle3)"
    )
    _add_ngram_options(bench_parser)
    bench_parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KIND_NAMES,
        help="measure these draft kinds side by side, each on a stack of its own: chain, tree (the shape flags', or "
        f"topk {TREE_KIND.topk} with {TREE_KIND.num_draft_tokens} draft tokens), ngram, "
        "hybrid (the --draft model with n-gram drafts merged in)",
    )
    bench_parser.add_argument("--address", help="a running stack to measure (default: start one)")
    bench_parser.add_argument("--num-prompts", type=int, default=BenchSettings.num_prompts)
    bench_parser.add_argument("--max-new-tokens", type=int, default=BenchSettings.max_new_tokens)
    bench_parser.add_argument("--concurrency", type=int, nargs="+", default=list(BenchSettings.concurrency))
    bench_parser.add_argument("--speculative-num-steps", type=int, default=BenchSettings.num_steps)
    _add_tree_options(bench_parser)
    bench_parser.add_argument(
        "--adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=BenchSettings.adaptive_k,
        help="as on tandem serve; --no-adaptive-k measures a fixed k (both setups)",
    )
    bench_parser.add_argument(
        "--draft-ahead",
        type=_non_negative,
        default=BenchSettings.draft_ahead,
        metavar="N",
        help="as on tandem serve, for the started stack (the colocated engine has nothing to overlap)",
    )
    bench_parser.add_argument(
        "--push-drafts",
        action=argparse.BooleanOptionalAction,
        default=BenchSettings.push_drafts,
        help="as on tandem serve, for the started stack",
    )
    bench_parser.add_argument("--draft-replicas", type=int, default=BenchSettings.draft_replicas)
    bench_parser.add_argument("--dtype", choices=DTYPES, default=BenchSettings.dtype, help="of target and draft")
    _add_threads(
        bench_parser, "the target (started stack, colocated, transformers)", "0: their default", "--target-threads"
    )
    _add_threads(bench_parser, "the started stack's draft", "0: tandem serve's default", "--draft-threads")
    bench_parser.add_argument(
        "--repeats", type=int, default=BenchSettings.repeats, help="runs of each configuration; medians are reported"
    )
    bench_parser.add_argument("--no-colocated", action="store_true", help="skip the one-process baseline")
    bench_parser.add_argument(
        "--no-transformers", action="store_true", help="skip the Hugging Face transformers rows (greedy, prompt lookup)"
    )
    bench_parser.add_argument(
        "--save-requests", type=Path, help="also write every request's tokens and statistics to this JSON file"
    )
    bench_parser.add_argument("--out", type=Path, default=BenchSettings.out_dir)
    _add_load_parser(commands)

    scale_parser = commands.add_parser("scale", help="change the number of draft replicas of a running stack")
    scale_parser.add_argument("--draft-replicas", type=int, required=True)
    scale_parser.add_argument("--address", default=f"127.0.0.1:{AdminSettings.port}", help="the admin port")
    add_admin_token_options(scale_parser, "the orchestrator's admin token")
    add_tls_options(scale_parser, "presented to the admin port (it asks for none)")

    generate_parser = commands.add_parser("generate", help="stream a completion from a running Tandem")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument("--address", default=f"127.0.0.1:{ServeSettings.port}")
    generate_parser.add_argument("--max-new-tokens", type=int, default=0, help="0: the server default")
    generate_parser.add_argument("--temperature", type=float, default=0.0)
    generate_parser.add_argument("--top-p", type=float, default=0.0, help="0: no nucleus filtering")
    generate_parser.add_argument("--top-k", type=int, default=0)
    generate_parser.add_argument("--seed", type=int, help="seed of sampling (0 is a seed); default: not seeded")
    generate_parser.add_argument("--stop", action="append", default=[])
    generate_parser.add_argument("--ignore-eos", action="store_true")
    generate_parser.add_argument("--no-speculation", action="store_true")
    add_api_key_options(generate_parser, "the orchestrator's API key")
    add_tls_options(generate_parser, "presented to the orchestrator (it asks for none)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in SERVICE_ENVIRONMENT_COMMANDS:
        apply_service_environment()
    if args.command == "serve":
        # No --target: the demo pair (with the demo head unless --draft names another). A --target of
        # your own gets no draft unless --draft is given: the demo head only fits the demo target.
        target_dir = _model_dir(args.target, DEMO_TARGET, "--target")
        ngram = _ngram(args)
        if ngram is not None:
            draft_dir = None
            if args.draft_replicas != ServeSettings.draft_replicas:
                raise SystemExit("tandem: --draft ngram drafts in the orchestrator and starts no --draft-replicas")
        else:
            draft_dir = args.draft if args.target is not None else _model_dir(args.draft, DEMO_DRAFT, "--draft")
        hybrid = _hybrid(args)
        if hybrid is not None and draft_dir is None:
            raise SystemExit("tandem: --hybrid-ngram merges n-gram drafts into a draft model's: give --draft DIR")
        if args.ray_address is not None and args.launcher != "ray":
            raise SystemExit("tandem: --ray-address needs --launcher ray")
        try:
            if args.launcher == "ray":
                RAY.require("--launcher ray")
            placement = placement_of(args, ranks=args.tp)
            if args.launcher == "ray" and placement.device != "cpu":
                raise StartupError(f"--launcher ray: places services on CPUs only for now, not {placement.device}")
        except StartupError as error:
            print(f"tandem serve cannot start: {error}", file=sys.stderr)
            return 2
        settings = ServeSettings(
            target_dir=target_dir,
            draft_dir=draft_dir,
            ngram=ngram,
            draft_replicas=args.draft_replicas,
            host=args.host,
            port=args.port,
            scheduler=scheduler_settings_of(args),
            aux_layer_convention=args.aux_layer_convention,
            dtype=placement.dtype,
            device=placement.device,
            cache=_cache(args, placement),
            launcher=args.launcher,
            ray_address=args.ray_address,
            tp=args.tp,
            target_threads=args.target_threads,
            draft_threads=args.draft_threads,
            mtp_feedback=args.mtp_feedback,
            mtp_mode=args.mtp_mode,
            security=_serve_security(args),
            http_port=None if args.no_http else args.http_port,
            chat_template=args.chat_template or (DEMO_CHAT_TEMPLATE if args.target is None else None),
            served_model_name=args.served_model_name,
        )
        if settings.launcher == "ray":
            from launch.ray_cluster import serve_on_ray  # imports ray: only on this path

            return serve_on_ray(settings)
        return serve(settings)
    if args.command == "bench":
        from bench.main import run_benchmark

        if args.repeats < 1:
            raise SystemExit(f"tandem: --repeats must be at least 1, got {args.repeats}")
        if args.draft == NGRAM and args.draft_replicas != BenchSettings.draft_replicas:
            raise SystemExit("tandem: --draft ngram drafts in the orchestrator and starts no --draft-replicas")
        if args.kinds and (args.draft == NGRAM or args.hybrid_ngram or args.address):
            raise SystemExit(
                "tandem: --kinds names the draft kinds: give their draft model with --draft (not ngram), no "
                "--hybrid-ngram (name the hybrid kind) and no --address (each kind starts its own stack)"
            )
        bench = BenchSettings(
            target_dir=_model_dir(args.target, DEMO_TARGET, "--target"),
            draft_dir=None if args.draft == NGRAM else _model_dir(args.draft, DEMO_DRAFT, "--draft"),
            ngram=_ngram_lengths(args, NgramSettings()) if args.kinds else _ngram(args),
            hybrid=_hybrid_settings(args) if args.kinds else _hybrid(args),
            kinds=tuple(args.kinds or ()),
            address=args.address,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            concurrency=tuple(args.concurrency),
            num_steps=args.speculative_num_steps,
            tree=tree_shape_of(args),
            adaptive_k=args.adaptive_k,
            draft_ahead=args.draft_ahead,
            push_drafts=args.push_drafts,
            draft_replicas=args.draft_replicas,
            dtype=args.dtype,
            target_threads=args.target_threads,
            draft_threads=args.draft_threads,
            repeats=args.repeats,
            colocated=not args.no_colocated,
            transformers=not args.no_transformers,
            out_dir=args.out,
            save_requests=args.save_requests,
        )
        print(run_benchmark(bench).read_text())
        return 0
    if args.command == "bench-load":
        return _bench_load(args)
    if args.command == "generate":
        from launch.client import generate

        return generate(args)
    if args.command == "scale":
        from launch.client import scale

        return scale(args.address, args.draft_replicas, client_security_of(args), admin_token_of(args))
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

        placement = placement_of(args, ranks=args.tp)
        target = TargetSettings(
            model_dir=args.model,
            dtype=placement.dtype,
            device=placement.device,
            max_context=args.max_context,
            cache=_cache(args, placement),
            tp=args.tp,
            threads=args.threads,
            metrics_port=args.metrics_port,
        )
        asyncio.run(serve_target(target, _listen(args, internal_security_of(args))))
    elif args.command == "draft":
        from draft_server.main import serve_draft

        placement = placement_of(args)
        draft = DraftSettings(
            model_dir=args.model,
            target_address=args.target_address,
            replica_id=args.replica_id,
            num_steps=args.speculative_num_steps,
            tree=tree_shape_of(args),
            aux_layer_convention=args.aux_layer_convention,
            cache=_cache(args, placement),
            dtype=placement.dtype,
            device=placement.device,
            threads=args.threads,
            mtp_feedback=args.mtp_feedback,
            mtp_mode=args.mtp_mode,
            target_security=internal_security_of(args),
            metrics_port=args.metrics_port,
        )
        asyncio.run(serve_draft(draft, _listen(args, internal_security_of(args))))
    elif args.command == "orchestrator":
        from orchestrator.main import serve_orchestrator

        orchestrator = OrchestratorSettings(
            target_address=args.target_address,
            draft_addresses=tuple(args.draft_address),
            tokenizer_dir=args.tokenizer,
            scheduler=scheduler_settings_of(args),
            default_max_new_tokens=args.default_max_new_tokens,
            max_request_bytes=args.max_request_bytes,
            scaler_address=args.scaler_address,
            api_key=api_key_of(args),
            admin=admin_settings_of(args),
            internal_security=internal_security_of(args),
            draft_discovery=_discovery(args),
            http=HttpSettings(port=args.http_port, ready_file=args.http_ready_file, chat_template=args.chat_template),
            served_model_name=args.served_model_name,
            ngram=_ngram(args),
        )
        public = Insecure() if args.public_plaintext else public_security_of(args)
        asyncio.run(serve_orchestrator(orchestrator, _listen(args, public)))


if __name__ == "__main__":
    sys.exit(main())
