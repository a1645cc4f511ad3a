"""The security options of the `tandem` commands that are no settings field: TLS files, the API key, the admin token.

Secrets never get a default from the environment in the parser (argparse would print it in --help); they are
resolved after parsing by `tandem.auth.resolve_secret`: the flag, its `-file` twin, or the environment variable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.auth import ADMIN_TOKEN_VARIABLE, API_KEY_VARIABLE, resolve_secret
from tandem.transport import Tls, TransportConfigError, TransportSecurity, internal_security, public_security


def _secret_options(parser: argparse.ArgumentParser, flag: str, variable: str, what: str) -> None:
    parser.add_argument(flag, help=f"{what} (or ${variable}, or {flag}-file; visible to `ps` when given here)")
    parser.add_argument(f"{flag}-file", type=Path, help=f"a file holding the {what}")


def add_api_key_options(parser: argparse.ArgumentParser, what: str) -> None:
    _secret_options(parser, "--api-key", API_KEY_VARIABLE, what)


def add_admin_token_options(parser: argparse.ArgumentParser, what: str) -> None:
    _secret_options(parser, "--admin-token", ADMIN_TOKEN_VARIABLE, what)


def api_key_of(args: argparse.Namespace) -> str | None:
    return _secret(args.api_key, args.api_key_file, API_KEY_VARIABLE, "--api-key")


def admin_token_of(args: argparse.Namespace) -> str | None:
    return _secret(args.admin_token, args.admin_token_file, ADMIN_TOKEN_VARIABLE, "--admin-token")


def _secret(value: str | None, file: Path | None, variable: str, flag: str) -> str | None:
    try:
        return resolve_secret(value, file, variable, flag)
    except ValueError as error:
        raise SystemExit(f"tandem: {error}") from None


def add_tls_options(parser: argparse.ArgumentParser, role: str) -> None:
    parser.add_argument("--tls-cert", type=Path, help=f"PEM certificate {role}")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        type=Path,
        help="PEM CA certificate: peers are verified against it; internal servers given one require client "
        "certificates signed by it (mutual TLS)",
    )


def internal_security_of(args: argparse.Namespace) -> TransportSecurity:
    """Between services: mutual TLS with all three files, TLS with cert and key, plaintext with none."""
    try:
        return internal_security(args.tls_cert, args.tls_key, args.tls_ca)
    except TransportConfigError as error:
        raise SystemExit(f"tandem: {error}") from None


def public_security_of(args: argparse.Namespace) -> TransportSecurity:
    """The orchestrator's public (and admin) port: TLS with --tls-cert/--tls-key, no client certificates asked."""
    try:
        return public_security(args.tls_cert, args.tls_key)
    except TransportConfigError as error:
        raise SystemExit(f"tandem: {error}") from None


def client_security_of(args: argparse.Namespace) -> TransportSecurity:
    """A client command's channel: TLS when any --tls-* is given (verifying with --tls-ca), else plaintext."""
    if args.tls_cert is None and args.tls_key is None and args.tls_ca is None:
        return internal_security(None, None, None)
    try:
        return Tls(args.tls_cert, args.tls_key, args.tls_ca)
    except TransportConfigError as error:
        raise SystemExit(f"tandem: {error}") from None
