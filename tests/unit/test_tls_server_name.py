"""`--tls-server-name`: channels that dial an address other than the name in the server's certificate (draft
discovery dials pods by IP, their certificate names the headless Service) check the certificate for that name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from launch.cli import main as cli_main
from tandem.certificates import make_certificates
from tandem.serving import ListenSettings, start_server
from tandem.transport import Insecure, Tls, TransportConfigError, TransportSecurity
from tests.helpers.secured_calls import health_code

SERVICE_NAME = "rel-tandem-draft-headless"  # what the chart's certificate names; never the address dialled


def test_a_certificate_for_another_name_is_accepted_only_under_that_name(tmp_path: Path) -> None:
    # A certificate for the Service name only: no IP address, so dialling 127.0.0.1 cannot match it.
    files = make_certificates(tmp_path, common_name="draft", dns_names=(SERVICE_NAME,), ip_addresses=())
    client = Tls(files.cert, files.key, files.ca)

    async def scenario() -> dict[str, grpc.StatusCode]:
        listen = ListenSettings(security=Tls(files.cert, files.key, files.ca, client_auth=True))
        server, _, address = await start_server(lambda server: None, [], listen)
        assert address.startswith("127.0.0.1:")
        try:
            clients: dict[str, TransportSecurity] = {
                "service name": client.with_server_name(SERVICE_NAME),
                "address dialled": client,
                "another name": client.with_server_name("rel-tandem-target"),
                "service name reset": client.with_server_name(SERVICE_NAME).with_server_name(None),
            }
            return {name: await asyncio.to_thread(health_code, security, address) for name, security in clients.items()}
        finally:
            await server.stop(grace=None)

    answers = asyncio.run(scenario())
    assert answers.pop("service name") == grpc.StatusCode.OK
    assert answers == dict.fromkeys(answers, grpc.StatusCode.UNAVAILABLE)


def test_a_server_name_is_refused_where_no_certificate_is_checked() -> None:
    assert Insecure().with_server_name(None) == Insecure()
    with pytest.raises(TransportConfigError, match="--tls-server-name draft: plaintext channels check no certificate"):
        Insecure().with_server_name("draft")
    with pytest.raises(TransportConfigError, match="--tls-server-name: the name is empty"):
        Tls().with_server_name(" ")
    assert "server certificate for draft" in Tls().with_server_name("draft").describe()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "--tls-server-name names the certificate of replicas found by --draft-dns"),
        (["--draft-dns", "draft:50062"], "--tls-server-name needs --tls-ca"),
    ],
)
def test_the_orchestrator_refuses_a_server_name_that_would_do_nothing(
    arguments: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # what a service command sets in this process; restored afterwards
    command = ["orchestrator", "--target-address", "127.0.0.1:1", "--tokenizer", "none", *arguments]
    with pytest.raises(SystemExit, match=message):
        cli_main([*command, "--tls-server-name", SERVICE_NAME])
