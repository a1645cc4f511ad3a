"""Transport security of every gRPC server and channel, and of the HTTP API: plaintext, TLS, or mutual TLS.

One seam: a server binds its port through `security.add_port` and a client opens its channel through
`security.aio_channel` / `security.channel`; no call site asks which kind it has.

- `Insecure`: plaintext (loopback stacks without `--internal-tls`, tests of other things).
- `Tls`: the server presents a certificate; a client verifies it against `ca` (None: the system's roots) and, when
  it has a certificate of its own, presents it. The public Generate port and the HTTP API beside it use it: their
  clients prove who they are with the API key, not with certificates (the CA of --tls-ca is the services' own).
- `Tls(client_auth=True)`, mutual TLS: the server also requires a client certificate signed by `ca`. The internal
  services (target, draft replicas, and the orchestrator as their client) use it when given a CA.

An HTTP server beside a gRPC port (the orchestrator's OpenAI-compatible API) binds with
`security.http_server_context()`: the same certificate and the same client-certificate rule as that port, so that the
public port's TLS covers the API key on HTTP too. None: plain HTTP.

A client checks the server's certificate against the name it dials, unless `with_server_name(NAME)` makes it check
NAME instead: draft discovery dials pods by IP address, while their certificate names the headless Service.

Certificates are files, read when a port is bound or a channel opened, so that settings holding a transport
security stay small, picklable (Ray actors) and free of key material.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import grpc

from tandem.grpc_util import channel_options


class TransportSecurity(Protocol):
    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        """Binds `address` ("host:port", port 0: any free port) on `server`; returns the bound port."""
        ...

    def aio_channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.aio.Channel:
        """An asyncio channel to `address` (channel_options() when options is None)."""
        ...

    def channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.Channel:
        """A blocking channel to `address` (channel_options() when options is None)."""
        ...

    def http_server_context(self) -> ssl.SSLContext | None:
        """What an HTTP server serving beside this port wraps its connections in: the same certificate and the same
        client-certificate rule (None: plain HTTP). TransportConfigError naming the flag for unusable files."""
        ...

    def describe(self) -> str:
        """A few words for logs: what protects the traffic (never key material)."""
        ...

    def with_server_name(self, name: str | None) -> TransportSecurity:
        """The same security, whose channels expect the server's certificate to name `name` whatever address they
        dial (None: the address dialled). Raises TransportConfigError where no certificate is checked."""
        ...


def _options(options: Sequence[tuple[str, int]] | None) -> list[tuple[str, int | str]]:
    return list(channel_options() if options is None else options)


def read_pem(path: Path, flag: str) -> bytes:
    """The contents of a certificate or key file; TransportConfigError naming `flag` and the file if unusable."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TransportConfigError(f"{flag} {path}: cannot be read ({error.strerror})") from error
    if not data.strip():
        raise TransportConfigError(f"{flag} {path}: the file is empty")
    return data


class TransportConfigError(ValueError):
    """Certificate files that do not make a usable transport security; the message names the flag and file."""


@dataclass(frozen=True)
class Insecure:
    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        return server.add_insecure_port(address)

    def aio_channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(address, options=_options(options))

    def channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.Channel:
        return grpc.insecure_channel(address, options=_options(options))

    def http_server_context(self) -> ssl.SSLContext | None:
        return None

    def describe(self) -> str:
        return "plaintext"

    def with_server_name(self, name: str | None) -> TransportSecurity:
        if name is not None:
            raise TransportConfigError(f"--tls-server-name {name}: plaintext channels check no certificate")
        return self


@dataclass(frozen=True)
class Tls:
    """Server: presents cert/key; with `client_auth`, requires a client certificate signed by ca (mutual TLS).
    Client: verifies the server with ca (None: the system's roots) and presents cert/key when set."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    client_auth: bool = False
    server_name: str | None = None  # the name the server's certificate must hold (None: the address dialled)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise TransportConfigError("--tls-cert and --tls-key: give both or neither")
        if self.client_auth and (self.cert is None or self.ca is None):
            raise TransportConfigError("mutual TLS needs --tls-cert, --tls-key and --tls-ca")
        if self.server_name is not None and not self.server_name.strip():
            raise TransportConfigError("--tls-server-name: the name is empty")

    def _identity(self) -> tuple[bytes, bytes] | None:
        """(private key, certificate chain) as PEM, or None without a certificate."""
        if self.cert is None or self.key is None:
            return None
        return read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert")

    def _roots(self) -> bytes | None:
        return None if self.ca is None else read_pem(self.ca, "--tls-ca")

    def server_credentials(self) -> grpc.ServerCredentials:
        identity = self._identity()
        if identity is None:
            raise TransportConfigError("serving TLS needs --tls-cert and --tls-key")
        if self.client_auth:
            return grpc.ssl_server_credentials([identity], root_certificates=self._roots(), require_client_auth=True)
        return grpc.ssl_server_credentials([identity])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        identity = self._identity()
        key, chain = identity if identity is not None else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=self._roots(), private_key=key, certificate_chain=chain)

    def add_port(self, server: grpc.Server | grpc.aio.Server, address: str) -> int:
        return server.add_secure_port(address, self.server_credentials())

    def http_server_context(self) -> ssl.SSLContext | None:
        if self.cert is None or self.key is None:
            raise TransportConfigError("serving TLS needs --tls-cert and --tls-key")
        read_pem(self.cert, "--tls-cert")  # a missing or empty file is named as server_credentials names it
        read_pem(self.key, "--tls-key")
        # Purpose.CLIENT_AUTH: a server's context with the default ciphers; no client certificate is asked for
        # unless client_auth, as gRPC's ssl_server_credentials does.
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2  # gRPC's floor too
        try:
            context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as error:
            raise TransportConfigError(
                f"--tls-cert {self.cert} and --tls-key {self.key}: not a certificate and its private key ({error})"
            ) from error
        if self.client_auth:
            assert self.ca is not None  # __post_init__ refuses client_auth without a CA
            read_pem(self.ca, "--tls-ca")
            try:
                context.load_verify_locations(cafile=self.ca)
            except ssl.SSLError as error:
                raise TransportConfigError(f"--tls-ca {self.ca}: not a CA certificate ({error})") from error
            context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(["http/1.1"])  # aiohttp serves HTTP/1.1 only
        return context

    def _channel_options(self, options: Sequence[tuple[str, int]] | None) -> list[tuple[str, int | str]]:
        chosen = _options(options)
        if self.server_name is not None:
            # gRPC then checks the certificate (and sends SNI) for this name instead of the dialled address.
            chosen.append(("grpc.ssl_target_name_override", self.server_name))
        return chosen

    def aio_channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(address, self.channel_credentials(), options=self._channel_options(options))

    def channel(self, address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.Channel:
        return grpc.secure_channel(address, self.channel_credentials(), options=self._channel_options(options))

    def describe(self) -> str:
        kind = "mutual TLS" if self.client_auth else "TLS"
        return kind if self.server_name is None else f"{kind} (server certificate for {self.server_name})"

    def with_server_name(self, name: str | None) -> TransportSecurity:
        return replace(self, server_name=name)


def internal_security(cert: Path | None, key: Path | None, ca: Path | None) -> TransportSecurity:
    """What a service uses between services, from its --tls-cert/--tls-key/--tls-ca.

    All three: mutual TLS. cert and key: TLS (servers present the certificate; clients verify with the system roots).
    ca alone: TLS as a client only (a service that serves nothing with it). None: plaintext.
    """
    if cert is None and key is None and ca is None:
        return Insecure()
    if cert is not None and key is not None and ca is not None:
        return Tls(cert, key, ca, client_auth=True)
    return Tls(cert, key, ca)


def public_security(cert: Path | None, key: Path | None) -> TransportSecurity:
    """The public port's (and its HTTP API's): TLS with cert/key (clients are not asked for certificates), else
    plaintext."""
    if cert is None and key is None:
        return Insecure()
    return Tls(cert, key)
