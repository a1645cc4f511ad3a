"""`tandem generate` and `tandem scale`: a completion streamed from a running orchestrator, and its replica count."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from launch.security_flags import (
    add_admin_token_options,
    add_api_key_options,
    add_tls_options,
    api_key_of,
    client_security_of,
)
from launch.serve_settings import ServeSettings
from orchestrator.settings import AdminSettings
from tandem.auth import bearer_metadata
from tandem.resuming import Reconnects, StreamBroken, resuming_stream
from tandem.transport import TransportSecurity
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc


def add_client_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    scale_parser = commands.add_parser("scale", help="change the number of draft replicas of a running stack")
    scale_parser.add_argument("--draft-replicas", type=int, required=True)
    scale_parser.add_argument("--address", default=f"127.0.0.1:{AdminSettings.port}", help="the admin port")
    add_admin_token_options(scale_parser, "the orchestrator's admin token")
    add_tls_options(scale_parser, "presented to the admin port (it asks for none)")

    generate_parser = commands.add_parser("generate", help="stream a completion from a running Tandem")
    generate_parser.add_argument("prompt")
    generate_parser.add_argument(
        "--address",
        action="append",
        help=f"an orchestrator (default 127.0.0.1:{ServeSettings.port}); give several to resume a broken stream on "
        "the next",
    )
    generate_parser.add_argument(
        "--reconnects",
        type=int,
        default=Reconnects.attempts,
        help="failed attempts in a row after which a broken stream is given up (each resumes it); 0: none",
    )
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


def scale(address: str, draft_replicas: int, security: TransportSecurity, admin_token: str | None) -> int:
    """Asks the orchestrator's admin port (and through it the launcher) to run `draft_replicas` replicas."""
    with security.channel(address) as channel:
        admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
        request = orchestrator_pb2.ScaleRequest(draft_replicas=draft_replicas)
        try:
            response = admin.Scale(request, timeout=3600, metadata=bearer_metadata(admin_token))
        except grpc.RpcError as error:
            print(f"tandem scale: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    for replica in response.replicas:
        print(f"{replica.replica_id}\t{replica.address}\t{replica.state}\t{replica.outstanding} requests")
    return 0


def generate(args: argparse.Namespace) -> int:
    request = orchestrator_pb2.GenerateRequest(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        disable_speculation=args.no_speculation,
    )
    security = client_security_of(args)
    started = time.perf_counter()
    responses = resuming_stream(
        args.address or [f"127.0.0.1:{ServeSettings.port}"],
        request,
        security.channel,
        metadata=bearer_metadata(api_key_of(args)),
        reconnects=Reconnects(attempts=max(0, args.reconnects)),
        on_reconnect=_reconnecting,
    )
    try:
        for response in responses:
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.finish_reason:
                _print_stats(response, time.perf_counter() - started)
    except grpc.RpcError as error:
        print(f"\ntandem generate: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except StreamBroken as error:
        print(f"\ntandem generate: {error}", file=sys.stderr)
        return 1
    return 0


def _reconnecting(address: str, cause: str, tokens: int) -> None:
    print(f"\n[tandem generate: resuming after {tokens} tokens at {address} ({cause})]", file=sys.stderr, flush=True)


def _print_stats(response: orchestrator_pb2.GenerateResponse, seconds: float) -> None:
    stats = response.stats
    mean_acceptance = 1 + stats.accepted_tokens / stats.rounds if stats.rounds else 0.0
    # From sending the request to its last token: prompt processing, streaming and any resume included.
    rate = stats.completion_tokens / seconds
    print(
        f"\n[finish_reason={response.finish_reason} prompt_tokens={stats.prompt_tokens} "
        f"completion_tokens={stats.completion_tokens} rounds={stats.rounds} "
        f"draft_tokens={stats.draft_tokens} accepted_tokens={stats.accepted_tokens} "
        f"mean_acceptance_length={mean_acceptance:.2f} tokens_per_second={rate:.1f}]"
    )
