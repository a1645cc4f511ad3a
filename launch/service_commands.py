"""`tandem target|draft|orchestrator`: one service per process, as `tandem serve`'s launcher starts them.

Each parser holds its settings' options (tandem.flags), the device request of target and draft, and what is no
settings field: where the service listens, its TLS files and secrets, and the orchestrator's DNS discovery.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from draft_server.settings import DraftSettings
from launch.devices import placement_of
from launch.model_dirs import NGRAM
from launch.security_flags import (
    add_admin_token_options,
    add_api_key_options,
    add_tls_options,
    admin_token_of,
    api_key_of,
    internal_security_of,
    public_security_of,
)
from launch.serve_settings import ServeSettings
from orchestrator.settings import AdminSettings, DiscoverySettings, OrchestratorSettings, parse_host_port
from tandem import flags
from tandem.devices import DeviceRequest
from tandem.errors import StartupError
from tandem.grpc_util import KEEPALIVE_HELP, KEEPALIVE_TIMEOUT_S, set_keepalive_timeout
from tandem.serving import ListenSettings
from tandem.settings import KVCacheSettings
from tandem.transport import Insecure, TransportSecurity
from target_server.settings import TargetSettings

T = TypeVar("T")


def _add_listen(parser: argparse.ArgumentParser, default_port: int = ListenSettings.port) -> None:
    # ListenSettings (tandem.serving) carries no options: it holds the transport security too, and the orchestrator's
    # port has another default.
    parser.add_argument("--host", default=ListenSettings.host)
    parser.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    parser.add_argument("--ready-file", type=Path, help="write the bound host:port here once serving")
    parser.add_argument(
        "--keepalive-timeout", type=flags.keepalive_seconds, default=KEEPALIVE_TIMEOUT_S, help=KEEPALIVE_HELP
    )


def _listen(args: argparse.Namespace, security: TransportSecurity) -> ListenSettings:
    return ListenSettings(host=args.host, port=args.port, ready_file=args.ready_file, security=security)


def add_service_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    target = commands.add_parser("target", help="run the target service")
    flags.add_options(target, TargetSettings)
    flags.add_options(target, DeviceRequest)
    _add_listen(target)
    add_tls_options(target, "of this service")

    draft = commands.add_parser("draft", help="run one draft replica")
    flags.add_options(draft, DraftSettings)
    flags.add_options(draft, DeviceRequest)
    _add_listen(draft)
    add_tls_options(draft, "of this service, also presented to the target")
    _add_orchestrator_parser(commands)


def _add_orchestrator_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("orchestrator", help="run the public orchestrator service")
    parser.add_argument("--draft", choices=[NGRAM], help="ngram: draft here by prompt lookup, with no draft replicas")
    flags.add_options(parser, OrchestratorSettings)
    parser.add_argument(
        "--draft-dns",
        type=flags.checked(parse_host_port),
        help="HOST:PORT: follow the addresses HOST resolves to as draft replicas (a Kubernetes headless Service)",
    )
    parser.add_argument(
        "--draft-dns-interval",
        type=flags.positive_seconds,
        default=DiscoverySettings.interval_s,
        help="seconds between resolutions of --draft-dns",
    )
    parser.add_argument(
        "--tls-server-name",
        help="with TLS: the name the certificates of replicas found by --draft-dns must hold (they are dialled by IP "
        "address; e.g. the headless Service's name); default: the address dialled",
    )
    _add_listen(parser, default_port=ServeSettings.port)
    add_api_key_options(parser, "key that Generate calls must carry as 'authorization: Bearer KEY'")
    add_admin_token_options(parser, "bearer token that OrchestratorAdmin calls must carry")
    add_tls_options(parser, "of the public port, and presented to target and drafts")
    parser.add_argument(
        "--public-plaintext",
        action="store_true",
        help="serve the public and admin ports without TLS even with --tls-cert (certificates only the stack trusts)",
    )


def _discovery(args: argparse.Namespace) -> DiscoverySettings | None:
    if args.tls_server_name is not None:
        if args.draft_dns is None:
            raise ValueError("--tls-server-name names the certificate of replicas found by --draft-dns; give it")
        if args.tls_ca is None:
            raise ValueError("--tls-server-name needs --tls-ca: without it no certificate is checked")
    if args.draft_dns is None:
        return None
    host, port = args.draft_dns
    return DiscoverySettings(host, port, interval_s=args.draft_dns_interval, tls_server_name=args.tls_server_name)


def target_settings_of(args: argparse.Namespace) -> TargetSettings:
    """Raises StartupError for a device the machine does not have."""
    placement = placement_of(flags.settings_of(DeviceRequest, args), ranks=args.tp)
    cache = placement.cache(flags.settings_of(KVCacheSettings, args))
    return flags.settings_of(TargetSettings, args, dtype=placement.dtype, device=placement.device, cache=cache)


def draft_settings_of(args: argparse.Namespace) -> DraftSettings:
    """Raises StartupError for a device the machine does not have, ValueError for flags that do not fit together."""
    placement = placement_of(flags.settings_of(DeviceRequest, args))
    return flags.settings_of(
        DraftSettings,
        args,
        dtype=placement.dtype,
        device=placement.device,
        cache=placement.cache(flags.settings_of(KVCacheSettings, args)),
        target_security=internal_security_of(args),
    )


def orchestrator_settings_of(args: argparse.Namespace) -> OrchestratorSettings:
    """Raises ValueError for flags that do not fit together."""
    return flags.settings_of(
        OrchestratorSettings,
        args,
        draft_discovery=_discovery(args),
        api_key=api_key_of(args),
        admin=flags.settings_of(AdminSettings, args, token=admin_token_of(args)),
        internal_security=internal_security_of(args),
    )


def run_service(args: argparse.Namespace) -> None:
    """Runs one service process until it is stopped; raises StartupError when it cannot start."""
    set_keepalive_timeout(args.keepalive_timeout)
    if args.command == "target":
        from target_server.main import serve_target

        target = _checked(target_settings_of, args)
        asyncio.run(serve_target(target, _listen(args, internal_security_of(args))))
    elif args.command == "draft":
        from draft_server.main import serve_draft

        draft = _checked(draft_settings_of, args)
        asyncio.run(serve_draft(draft, _listen(args, internal_security_of(args))))
    elif args.command == "orchestrator":
        orchestrator = _checked(orchestrator_settings_of, args)
        public = Insecure() if args.public_plaintext else public_security_of(args)
        hide_torch()
        from orchestrator.main import serve_orchestrator

        asyncio.run(serve_orchestrator(orchestrator, _listen(args, public)))


def hide_torch() -> None:
    """Makes torch absent from this process, before anything imports transformers. The orchestrator computes nothing
    and uses transformers for its tokenizer only, whose class and behaviour do not depend on torch; but where torch is
    installed transformers imports it on the way to AutoTokenizer (configuration_utils): more than half the CPU of an
    orchestrator's start. None in sys.modules is Python's mark of a module that is absent: importing it raises
    ModuleNotFoundError, and importlib.util.find_spec, which transformers asks, returns None.
    tests/unit/test_tokenizer.py checks that AutoTokenizer chooses alike with and without torch. A process that has
    already loaded either (a test calling main) keeps what it has: hiding torch there would break what loaded it."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(_without_torch_advice)


def _without_torch_advice(record: logging.LogRecord) -> bool:
    """False for transformers' advice that PyTorch was not found: in the orchestrator, that is the intent."""
    return not record.getMessage().startswith("PyTorch was not found")


def _checked(settings_of: Callable[[argparse.Namespace], T], args: argparse.Namespace) -> T:
    """The settings of the flags; SystemExit naming flags that do not fit together (a StartupError goes on: the
    machine cannot do what they ask)."""
    try:
        return settings_of(args)
    except StartupError:
        raise
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None
