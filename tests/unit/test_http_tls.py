"""The TLS an HTTP server takes from a TransportSecurity (http_server_context): the HTTP API beside the public port
serves HTTPS with the port's certificate and asks for client certificates exactly when the gRPC port would."""

from __future__ import annotations

import asyncio
import http.client
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from tandem.certificates import CertificateFiles, make_certificates
from tandem.transport import Insecure, Tls, TransportConfigError, TransportSecurity, public_security

Client = Callable[[int], str]  # port -> the body of GET /health, or why there was none (get)


def certificates(directory: Path) -> CertificateFiles:
    directory.mkdir()
    return make_certificates(directory)


def get(url: str, context: ssl.SSLContext | None) -> str:
    """The body of the answer, or why there was none: "certificate not trusted", or "no HTTP answer" when the
    connection ended without one (a TLS port that plain HTTP reached, a handshake the server refused)."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            body: bytes = response.read()
            return body.decode()
    except urllib.error.URLError as error:
        if isinstance(error.reason, ssl.SSLCertVerificationError):
            return "certificate not trusted"
        return "no HTTP answer"
    except (ConnectionError, http.client.HTTPException, ssl.SSLError):
        return "no HTTP answer"


def trusting(ca: Path, identity: CertificateFiles | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if identity is not None:
        context.load_cert_chain(identity.cert, identity.key)
    return context


def answers(security: TransportSecurity, clients: dict[str, Client]) -> dict[str, str]:
    """What each client gets from a server bound with `security`'s HTTP context."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def scenario() -> dict[str, str]:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=security.http_server_context()).start()
        port = runner.addresses[0][1]
        try:
            return {name: await asyncio.to_thread(client, port) for name, client in clients.items()}
        finally:
            await runner.cleanup()

    return asyncio.run(scenario())


def test_the_public_port_security_serves_https_to_clients_without_certificates(tmp_path: Path) -> None:
    ours, theirs = certificates(tmp_path / "ours"), certificates(tmp_path / "theirs")
    found = answers(
        public_security(ours.cert, ours.key),
        {
            "trusting our CA": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(ours.ca)),
            "with a client certificate": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(ours.ca, ours)),
            "trusting another CA": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(theirs.ca)),
            "plain HTTP": lambda port: get(f"http://127.0.0.1:{port}/health", None),
        },
    )
    assert found == {
        "trusting our CA": "ok",
        "with a client certificate": "ok",
        "trusting another CA": "certificate not trusted",  # the server presents our certificate
        "plain HTTP": "no HTTP answer",
    }


def test_mutual_tls_asks_http_clients_for_a_certificate_of_its_ca(tmp_path: Path) -> None:
    ours, theirs = certificates(tmp_path / "ours"), certificates(tmp_path / "theirs")
    found = answers(
        Tls(ours.cert, ours.key, ours.ca, client_auth=True),
        {
            "ours": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(ours.ca, ours)),
            "no certificate": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(ours.ca)),
            "another CA's": lambda port: get(f"https://127.0.0.1:{port}/health", trusting(ours.ca, theirs)),
        },
    )
    assert found == {"ours": "ok", "no certificate": "no HTTP answer", "another CA's": "no HTTP answer"}


def test_plaintext_serves_plain_http() -> None:
    assert Insecure().http_server_context() is None
    assert answers(Insecure(), {"plain": lambda port: get(f"http://127.0.0.1:{port}/health", None)}) == {"plain": "ok"}


def test_unusable_certificate_files_are_named(tmp_path: Path) -> None:
    files = certificates(tmp_path / "ours")
    with pytest.raises(TransportConfigError, match=r"--tls-key .*missing\.pem: cannot be read"):
        Tls(files.cert, tmp_path / "missing.pem").http_server_context()
    other = certificates(tmp_path / "other")
    with pytest.raises(TransportConfigError, match=r"--tls-cert .* and --tls-key .*: not a certificate and its"):
        Tls(files.cert, other.key).http_server_context()  # a key that is not the certificate's
    with pytest.raises(TransportConfigError, match=r"--tls-ca .*key\.pem: not a CA certificate"):
        Tls(files.cert, files.key, files.key, client_auth=True).http_server_context()
    with pytest.raises(TransportConfigError, match="serving TLS needs --tls-cert and --tls-key"):
        Tls(ca=files.ca).http_server_context()
