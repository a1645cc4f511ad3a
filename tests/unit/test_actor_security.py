"""What a service started as a Ray actor makes of its stack's TLS (launch.actor_security), without Ray."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from draft_server.settings import DraftSettings
from launch.actor_security import ActorSecurity
from launch.stack_security import ServeSecurity, StackSecurity
from orchestrator.settings import OrchestratorSettings
from tandem.certificates import INTERNAL_NAME, CertificatePems
from tandem.serving import ListenSettings
from tandem.transport import Insecure, Tls, TransportConfigError
from target_server.settings import TargetSettings

TARGET = TargetSettings(model_dir=Path("target"))
DRAFT = DraftSettings(model_dir=Path("draft"), target_address="10.0.0.1:50061", replica_id="draft-0")
ORCHESTRATOR = OrchestratorSettings(target_address="10.0.0.1:50061", draft_addresses=(), tokenizer_dir=Path("t"))


def private_dir(parent: Path, name: str) -> Path:
    """A directory as an actor's work directory is: new, 0700."""
    directory = parent / name
    directory.mkdir(mode=0o700, parents=True)
    return directory


def stack(tmp_path: Path, settings: ServeSecurity) -> StackSecurity:
    return StackSecurity.prepare(settings, private_dir(tmp_path, "launcher"))


def user_certificates(tmp_path: Path) -> ServeSecurity:
    """--tls-cert/--tls-key/--tls-ca of certificates made here (the throwaway maker makes a usable pair)."""
    directory = private_dir(tmp_path, "user")
    made = stack(directory, ServeSecurity(internal_tls=True)).files
    assert made is not None
    for name, path in (("ca.pem", made.ca), ("cert.pem", made.cert), ("key.pem", made.key)):
        (directory / name).write_bytes(path.read_bytes())
    return ServeSecurity(tls_cert=directory / "cert.pem", tls_key=directory / "key.pem", tls_ca=directory / "ca.pem")


def test_plaintext_stacks_change_nothing(tmp_path: Path) -> None:
    security = ActorSecurity.of(stack(tmp_path, ServeSecurity()))
    assert security == ActorSecurity()
    listen = ListenSettings()
    assert security.secure(DRAFT, listen, tmp_path) == (DRAFT, listen)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["launcher"]  # nothing written


def test_each_actor_writes_the_certificates_privately_and_serves_mutual_tls(tmp_path: Path) -> None:
    security = ActorSecurity.of(stack(tmp_path, ServeSecurity(internal_tls=True)))
    assert security.certificates is not None and not security.public_tls
    assert security.server_name == INTERNAL_NAME  # what the throwaway leaf names, wherever a service runs
    assert "PRIVATE KEY" not in repr(security)  # the key never shows in logs of settings
    actor_dir = private_dir(tmp_path, "target-actor")
    target, target_listen = security.secure(TARGET, ListenSettings(), actor_dir)
    files = {path.name: path for path in actor_dir.iterdir()}
    assert sorted(files) == ["ca.pem", "cert.pem", "key.pem"]
    assert {stat.S_IMODE(path.stat().st_mode) for path in files.values()} == {0o600}
    assert files["key.pem"].read_bytes() == security.certificates.key
    mutual = Tls(files["cert.pem"], files["key.pem"], files["ca.pem"], client_auth=True)
    assert target == TARGET and target_listen.security == mutual
    # Channels to other services check the peer for the certificate's name, not the address they dial.
    draft_dir = private_dir(tmp_path, "draft-actor")
    draft, draft_listen = security.secure(DRAFT, ListenSettings(), draft_dir)
    draft_mutual = Tls(draft_dir / "cert.pem", draft_dir / "key.pem", draft_dir / "ca.pem", client_auth=True)
    assert draft_listen.security == draft_mutual
    assert draft.target_security == Tls(
        draft_dir / "cert.pem", draft_dir / "key.pem", draft_dir / "ca.pem", client_auth=True, server_name=INTERNAL_NAME
    )


def test_the_orchestrator_serves_its_public_port_as_the_process_launcher_does(tmp_path: Path) -> None:
    internal_only = ActorSecurity.of(stack(tmp_path / "internal", ServeSecurity(internal_tls=True)))
    orchestrator, listen = internal_only.secure(ORCHESTRATOR, ListenSettings(), private_dir(tmp_path, "a"))
    assert listen.security == Insecure()  # --internal-tls: nobody outside the stack trusts its CA
    assert isinstance(orchestrator.internal_security, Tls) and orchestrator.internal_security.client_auth

    user = ActorSecurity.of(stack(tmp_path / "user", user_certificates(tmp_path / "user")))
    assert user.public_tls and user.server_name is None
    actor_dir = private_dir(tmp_path, "b")
    orchestrator, listen = user.secure(ORCHESTRATOR, ListenSettings(), actor_dir)
    cert, key, ca = actor_dir / "cert.pem", actor_dir / "key.pem", actor_dir / "ca.pem"
    assert listen.security == Tls(cert, key)  # TLS, no client certificates asked: clients bring the API key
    assert orchestrator.internal_security == Tls(cert, key, ca, client_auth=True)


def test_a_server_name_given_for_the_users_certificate_is_what_channels_check(tmp_path: Path) -> None:
    settings = dataclasses.replace(user_certificates(tmp_path), tls_server_name="tandem.ml.svc")
    named = ActorSecurity.of(stack(tmp_path, settings))
    orchestrator, _ = named.secure(ORCHESTRATOR, ListenSettings(), private_dir(tmp_path, "actor"))
    assert isinstance(orchestrator.internal_security, Tls)
    assert orchestrator.internal_security.server_name == "tandem.ml.svc"


def test_an_unreadable_certificate_file_is_named_on_the_launchers_machine(tmp_path: Path) -> None:
    settings = user_certificates(tmp_path)
    missing = dataclasses.replace(settings, tls_ca=tmp_path / "absent.pem")
    with pytest.raises(TransportConfigError, match=r"--tls-ca .*absent\.pem: cannot be read"):
        ActorSecurity.of(stack(tmp_path, missing))


def test_pems_are_written_only_into_new_files(tmp_path: Path) -> None:
    pems = CertificatePems(ca=b"ca", cert=b"cert", key=b"key")
    pems.write(tmp_path)
    with pytest.raises(FileExistsError):
        pems.write(tmp_path)  # never into a file someone else created first
