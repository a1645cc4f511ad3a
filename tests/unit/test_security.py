"""Bearer check, secret resolution, admin allow rule, throwaway certificates and the TLS transports they make."""

from __future__ import annotations

import asyncio
import ipaddress
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from launch.cli import main as cli_main
from launch.stack_security import ServeSecurity
from orchestrator.api.admin import address_allowed
from orchestrator.main import check_admin_settings
from orchestrator.settings import AdminSettings
from tandem.auth import Unauthenticated, check_bearer, resolve_secret
from tandem.certificates import INTERNAL_NAME, CertificateFiles, make_certificates
from tandem.errors import StartupError
from tandem.serving import ListenSettings, start_server
from tandem.transport import Insecure, Tls, TransportConfigError, TransportSecurity, internal_security
from tests.helpers.secured_calls import health_code

KEY = "s3cret-key-123"


def test_the_right_bearer_key_passes() -> None:
    check_bearer(f"Bearer {KEY}", KEY)
    check_bearer(f"bearer {KEY}", KEY)  # the scheme is case-insensitive (RFC 7235), the key is not


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing credentials"),
        ("", "missing credentials"),
        (f"Basic {KEY}", "expected 'Bearer <key>'"),
        ("Bearer", "expected 'Bearer <key>'"),
        ("Bearer s3cret-key-12", "the key is not valid"),
        (f"Bearer {KEY.upper()}", "the key is not valid"),
        (KEY, "expected 'Bearer <key>'"),
    ],
)
def test_a_wrong_or_missing_bearer_is_refused_without_echoing_a_key(header: str | None, message: str) -> None:
    with pytest.raises(Unauthenticated, match=message) as refused:
        check_bearer(header, KEY)
    assert KEY.lower() not in str(refused.value).lower()
    assert "s3cret" not in str(refused.value)


def test_a_secret_comes_from_the_flag_its_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TEST_TANDEM_SECRET", "from-env")
    assert resolve_secret("from-flag", None, "TEST_TANDEM_SECRET", "--api-key") == "from-flag"
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_secret(None, tmp_path / "key", "TEST_TANDEM_SECRET", "--api-key") == "from-file"
    assert resolve_secret(None, None, "TEST_TANDEM_SECRET", "--api-key") == "from-env"
    monkeypatch.delenv("TEST_TANDEM_SECRET")
    assert resolve_secret(None, None, "TEST_TANDEM_SECRET", "--api-key") is None


def test_conflicting_or_empty_secrets_are_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--api-key and --api-key-file"):
        resolve_secret("x", tmp_path / "empty", "TEST_TANDEM_SECRET", "--api-key")
    with pytest.raises(ValueError, match=r"--api-key-file .*empty: the file is empty"):
        resolve_secret(None, tmp_path / "empty", "TEST_TANDEM_SECRET", "--api-key")
    with pytest.raises(ValueError, match=r"--api-key-file .*missing: cannot be read"):
        resolve_secret(None, tmp_path / "missing", "TEST_TANDEM_SECRET", "--api-key")
    monkeypatch.setenv("TEST_TANDEM_SECRET", "  ")
    with pytest.raises(ValueError, match="TEST_TANDEM_SECRET: empty"):
        resolve_secret(None, None, "TEST_TANDEM_SECRET", "--api-key")


def test_add_replica_allow_rule() -> None:
    allowed = {"10.0.0.5:50062", "127.0.0.1:*"}
    assert address_allowed("10.0.0.5:50062", allowed)
    assert address_allowed("127.0.0.1:41234", allowed)
    assert not address_allowed("10.0.0.5:50063", allowed)
    assert not address_allowed("10.0.0.6:50062", allowed)
    assert not address_allowed("127.0.0.1", allowed)  # no port: not an address
    assert not address_allowed("evil.example:50062", allowed)


def test_certificates_are_a_ca_and_a_leaf_for_loopback_with_a_private_key_file(tmp_path: Path) -> None:
    files = make_certificates(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ca.pem", "cert.pem", "key.pem"]  # no CA key
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    leaf = x509.load_pem_x509_certificate(files.cert.read_bytes())
    leaf.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [INTERNAL_NAME, "localhost"]
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    usages = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_each_call_makes_a_new_ca(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = make_certificates(tmp_path / "a"), make_certificates(tmp_path / "b")
    ca = x509.load_pem_x509_certificate(first.ca.read_bytes())
    other_leaf = x509.load_pem_x509_certificate(second.cert.read_bytes())
    with pytest.raises(InvalidSignature):
        other_leaf.verify_directly_issued_by(ca)


def test_transport_flags_that_do_not_fit_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(TransportConfigError, match="--tls-cert and --tls-key"):
        internal_security(tmp_path / "cert.pem", None, None)
    assert isinstance(internal_security(None, None, None), Insecure)
    files = make_certificates(tmp_path)
    assert internal_security(files.cert, files.key, files.ca) == Tls(files.cert, files.key, files.ca, client_auth=True)
    with pytest.raises(TransportConfigError, match=r"--tls-ca .*nothing.pem: cannot be read"):
        Tls(files.cert, files.key, tmp_path / "nothing.pem", client_auth=True).server_credentials()


def test_mutual_tls_server_serves_only_clients_of_its_ca(tmp_path: Path) -> None:
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours_dir.mkdir()
    theirs_dir.mkdir()
    ours: CertificateFiles = make_certificates(ours_dir)
    theirs = make_certificates(theirs_dir)
    server_security = Tls(ours.cert, ours.key, ours.ca, client_auth=True)

    async def scenario() -> dict[str, grpc.StatusCode]:
        listen = ListenSettings(security=server_security)
        server, _, address = await start_server(lambda server: None, [], listen)
        try:
            clients: dict[str, TransportSecurity] = {
                "ours": Tls(ours.cert, ours.key, ours.ca),
                "plaintext": Insecure(),
                "no certificate": Tls(ca=ours.ca),
                "certificate of another CA": Tls(theirs.cert, theirs.key, ours.ca),
                "trusting another CA": Tls(ours.cert, ours.key, theirs.ca),
            }
            return {name: await asyncio.to_thread(health_code, client, address) for name, client in clients.items()}
        finally:
            await server.stop(grace=None)

    answers = asyncio.run(scenario())
    assert answers.pop("ours") == grpc.StatusCode.OK
    assert answers == dict.fromkeys(answers, grpc.StatusCode.UNAVAILABLE)


def test_an_admin_port_off_loopback_needs_a_token() -> None:
    check_admin_settings(AdminSettings(host="127.0.0.1"))
    check_admin_settings(AdminSettings(host="::1"))
    check_admin_settings(AdminSettings(host="0.0.0.0", token="t"))
    with pytest.raises(StartupError, match=r"--admin-host 0\.0\.0\.0: .* set --admin-token"):
        check_admin_settings(AdminSettings(host="0.0.0.0"))
    with pytest.raises(StartupError, match=r"--admin-host orchestrator\.internal"):
        check_admin_settings(AdminSettings(host="orchestrator.internal"))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--internal-tls", "--tls-cert", "c.pem"], "--internal-tls makes its own certificates"),
        (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "needs all of --tls-cert, --tls-key and --tls-ca"),
        (["--draft-replicas", "3", "--max-draft-replicas", "2"], "--draft-replicas 3 is above --max-draft-replicas"),
        (["--internal-tls", "--tls-server-name", "n"], "--tls-server-name is a name in the certificate of --tls-cert"),
        (
            ["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "--tls-server-name", "n"],
            "--tls-server-name needs --launcher ray",
        ),
        (
            [*("--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"), "--tls-server-name", " "],
            "--tls-server-name: the name is empty",
        ),
        (["--api-key", "k", "--api-key-file", "f"], "--api-key and --api-key-file: give one of them"),
    ],
)
def test_serve_refuses_security_flags_that_do_not_fit(
    arguments: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")  # what `serve` would set in this process; restored afterwards
    with pytest.raises(SystemExit, match=message):
        cli_main(["serve", *arguments])


def test_secrets_stay_out_of_settings_reprs() -> None:
    settings = ServeSecurity(api_key="k-1234567", admin_token="t-7654321")
    assert "k-1234567" not in repr(settings) and "t-7654321" not in repr(settings)
    assert "t-7654321" not in repr(AdminSettings(token="t-7654321"))
