"""The security of a stack that `tandem serve` starts: what its children are told, and how it talks to them.

`ServeSecurity` is what the user asked for (frozen, part of ServeSettings); `StackSecurity` is that made concrete
for one run: with `internal_tls` it holds the throwaway certificates (tandem.certificates) written into the
launcher's private work directory, which the launcher removes when it stops.

Secrets (API key, admin token) reach the orchestrator child through its environment, never its command line,
which any local user can read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.settings import AdminSettings
from tandem.auth import ADMIN_TOKEN_VARIABLE, API_KEY_VARIABLE, bearer_metadata
from tandem.certificates import CertificateFiles, make_certificates
from tandem.flags import flag, flag_of
from tandem.transport import Insecure, Tls, TransportSecurity, internal_security


@dataclass(frozen=True)
class ServeSecurity:
    """What `tandem serve` is asked to secure; refuses, on construction, combinations that cannot work."""

    api_key: str | None = field(default=None, repr=False)  # Generate requires it (tandem.auth)
    admin_port: int = field(
        default=AdminSettings.port, metadata=flag_of(AdminSettings, "port")
    )  # the orchestrator's admin port, on loopback
    admin_token: str | None = field(default=None, repr=False)
    max_draft_replicas: int = field(
        default=AdminSettings.max_draft_replicas, metadata=flag_of(AdminSettings, "max_draft_replicas")
    )
    # The user's certificates: every service, and the public port, use them (the CA verifies peers).
    tls_cert: Path | None = field(
        default=None,
        metadata=flag(
            "--tls-cert",
            "PEM certificate of every service and the public port (needs all three --tls-* flags)",
            parse=Path,
        ),
    )
    tls_key: Path | None = field(default=None, metadata=flag("--tls-key", "PEM private key of --tls-cert", parse=Path))
    tls_ca: Path | None = field(
        default=None,
        metadata=flag("--tls-ca", "PEM CA certificate: the services verify each other against it", parse=Path),
    )
    # A throwaway CA for the services' own traffic; the public port stays plaintext.
    internal_tls: bool = field(
        default=False,
        metadata=flag(
            "--internal-tls",
            "encrypt the services' own traffic with a throwaway CA (mutual TLS); the public port stays plaintext",
        ),
    )
    # The name the services' certificates are checked for, instead of the address dialled (--launcher ray on several
    # machines: services bind their node's address, which a certificate made beforehand cannot name). None: the address.
    tls_server_name: str | None = field(
        default=None,
        metadata=flag(
            "--tls-server-name",
            "with --launcher ray and --tls-cert: check the services' certificates for NAME instead of the address "
            "dialled (on several machines services bind their node's address)",
        ),
    )

    def __post_init__(self) -> None:
        given = [self.tls_cert is not None, self.tls_key is not None, self.tls_ca is not None]
        if self.internal_tls and any(given):
            raise ValueError("--internal-tls makes its own certificates: drop --tls-cert/--tls-key/--tls-ca")
        if any(given) and not all(given):
            raise ValueError(
                "tandem serve needs all of --tls-cert, --tls-key and --tls-ca (its services verify each other)"
            )
        if self.tls_server_name is not None:
            if not all(given):
                raise ValueError("--tls-server-name is a name in the certificate of --tls-cert: give the --tls-* files")
            if not self.tls_server_name.strip():
                raise ValueError("--tls-server-name: the name is empty")


@dataclass(frozen=True)
class StackSecurity:
    files: CertificateFiles | None  # what the services present and trust (None: plaintext between them)
    public_tls: bool  # the public and admin ports serve TLS with `files`
    settings: ServeSecurity

    @staticmethod
    def prepare(settings: ServeSecurity, workdir: Path) -> StackSecurity:
        """Makes the throwaway certificates into `workdir` when asked to."""
        if settings.internal_tls:
            directory = workdir / "tls"
            directory.mkdir(mode=0o700)
            return StackSecurity(make_certificates(directory), public_tls=False, settings=settings)
        if settings.tls_cert is not None and settings.tls_key is not None and settings.tls_ca is not None:
            files = CertificateFiles(ca=settings.tls_ca, cert=settings.tls_cert, key=settings.tls_key)
            return StackSecurity(files, public_tls=True, settings=settings)
        return StackSecurity(None, public_tls=False, settings=settings)

    def tls_arguments(self) -> list[str]:
        """The --tls-* arguments of every child."""
        if self.files is None:
            return []
        return ["--tls-cert", str(self.files.cert), "--tls-key", str(self.files.key), "--tls-ca", str(self.files.ca)]

    def public_arguments(self) -> list[str]:
        """The orchestrator child's flags for its public and admin ports: plaintext with --internal-tls."""
        return ["--public-plaintext"] if self.files is not None and not self.public_tls else []

    def orchestrator_environment(self) -> dict[str, str]:
        """This process's environment with the secrets the orchestrator reads (and without those it must not)."""
        environment = without_secrets(os.environ)
        if self.settings.api_key is not None:
            environment[API_KEY_VARIABLE] = self.settings.api_key
        if self.settings.admin_token is not None:
            environment[ADMIN_TOKEN_VARIABLE] = self.settings.admin_token
        return environment

    def internal(self) -> TransportSecurity:
        """The services' traffic between themselves (the launcher's Scaler serves with it too)."""
        if self.files is None:
            return Insecure()
        return internal_security(self.files.cert, self.files.key, self.files.ca)

    def admin_client(self) -> TransportSecurity:
        """How the launcher reaches the admin port, which serves what the public port serves."""
        if self.files is None or not self.public_tls:
            return Insecure()
        return Tls(self.files.cert, self.files.key, self.files.ca)

    def admin_metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.settings.admin_token)


def without_secrets(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` minus the API key and admin token: what services other than the orchestrator inherit."""
    return {name: value for name, value in environment.items() if name not in (API_KEY_VARIABLE, ADMIN_TOKEN_VARIABLE)}
