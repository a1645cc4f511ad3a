"""`tandem serve --launcher ray` with TLS, on a local Ray cluster of two CPUs.

The actors get the certificates as bytes and write them into their own private work directories (0700, files 0600,
removed when they stop). Two stacks:
- `--internal-tls`: throwaway certificates, checked for their own name (tandem.certificates.INTERNAL_NAME) by every
  channel between services; the public port stays plaintext, the internal ports refuse plaintext clients;
- `--tls-cert/--tls-key/--tls-ca` with a certificate that names no address, only `--tls-server-name`'s name (as on a
  cluster of several machines, whose services bind node addresses): every channel checks that name, the public port
  serves TLS to clients of the CA, and the internal ports serve only clients with a certificate of the CA.
A certificate file that cannot be read stops `tandem serve` before Ray starts, naming the flag and the file.
"""

from __future__ import annotations

import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.certificates import CertificateFiles, make_certificates
from tandem.transport import Insecure, Tls, TransportSecurity
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.helpers.secured_calls import call_code
from tests.integration.stack import generate, run_to_exit, serve
from tests.integration.test_greedy_equivalence import reference_greedy
from tests.integration.test_ray import (  # two_cpus: autouse, the same two-CPU machine as test_ray.py
    RAY,
    serving,
    two_cpus,  # noqa: F401
    wait_until_gone,
)

PROMPT = "def fibonacci(n):"
MAX_NEW_TOKENS = 16
SERVER_NAME = "tandem.ray.test"  # the only name in the user's certificate
ACTORS = ("target", "draft-0", "orchestrator")


def actor_dirs() -> set[Path]:
    """The Ray actors' work directories on this machine (ServiceActor: tandem-<service>-*)."""
    root = Path(tempfile.gettempdir())
    return {path for name in ACTORS for path in root.glob(f"tandem-{name}-*")}


def private_copies(before: set[Path]) -> set[Path]:
    """The work directories of this stack's actors, each checked: private, holding the certificates 0600."""
    written = actor_dirs() - before
    assert len(written) == len(ACTORS), written
    for directory in written:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        for name in ("ca.pem", "cert.pem", "key.pem"):
            assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, directory / name
    return written


def target_info_code(address: str, security: TransportSecurity) -> grpc.StatusCode:
    return call_code(
        security,
        address,
        lambda channel: target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=10),
    )


def greedy_over(address: str, security: TransportSecurity) -> list[int]:
    request = orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    token_ids: list[int] = []
    with security.channel(address) as channel:
        for response in orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=300):
            token_ids.extend(response.token_ids)
            if response.finish_reason:
                assert response.stats.draft_tokens > 0  # the draft actor proposed, over TLS to the target
                return token_ids
    raise AssertionError("stream ended without a finish_reason")


@pytest.fixture(scope="module")
def expected(llama_target: Path) -> list[int]:
    return reference_greedy(llama_target, PROMPT, MAX_NEW_TOKENS)


@pytest.fixture
def stranger(tmp_path: Path) -> Iterator[CertificateFiles]:
    """Certificates of a CA the stacks do not trust."""
    directory = tmp_path / "stranger"
    directory.mkdir()
    yield make_certificates(directory)


def test_internal_tls_under_ray_encrypts_the_actors_traffic(
    llama_target: Path, random_draft: Path, expected: list[int], stranger: CertificateFiles
) -> None:
    before = actor_dirs()
    arguments = (*RAY, "--internal-tls", "--speculative-num-steps", "3")
    with serve(llama_target, random_draft, *arguments) as stack:
        completion = generate(stack.address, prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        services = serving(stack.log)
        for name in ("target", "draft-0"):
            # Internal ports refuse plaintext clients and clients of another CA at the handshake, before any method.
            assert target_info_code(services[name][0], Insecure()) == grpc.StatusCode.UNAVAILABLE
            other = Tls(stranger.cert, stranger.key, stranger.ca)
            assert target_info_code(services[name][0], other) == grpc.StatusCode.UNAVAILABLE
        written = private_copies(before)
        assert stack.stop() == 0
    assert completion.token_ids == expected
    assert completion.stats.draft_tokens > 0  # draft-0 pulled rows from the target and proposed over mutual TLS
    # Each actor removed its directory, certificates and all, when it stopped.
    wait_until_gone([pid for _, pid in services.values()], [address for address, _ in services.values()])
    assert not any(directory.exists() for directory in written)


def test_user_certificates_under_ray_are_checked_for_the_server_name(
    tmp_path: Path, llama_target: Path, random_draft: Path, expected: list[int], stranger: CertificateFiles
) -> None:
    directory = tmp_path / "user"
    directory.mkdir()
    user = make_certificates(directory, common_name="tandem-ray", dns_names=(SERVER_NAME,), ip_addresses=())
    tls = ["--tls-cert", str(user.cert), "--tls-key", str(user.key), "--tls-ca", str(user.ca)]
    before = actor_dirs()
    arguments = (*RAY, *tls, "--tls-server-name", SERVER_NAME, "--speculative-num-steps", "3")
    with serve(llama_target, random_draft, *arguments) as stack:
        client = Tls(ca=user.ca, server_name=SERVER_NAME)  # the public port asks for no client certificate
        token_ids = greedy_over(stack.address, client)
        with pytest.raises(grpc.RpcError) as plaintext:
            greedy_over(stack.address, Insecure())
        services = serving(stack.log)
        target = services["target"][0]
        member = Tls(user.cert, user.key, user.ca, server_name=SERVER_NAME)
        assert target_info_code(target, member) == grpc.StatusCode.OK
        assert target_info_code(target, Insecure()) == grpc.StatusCode.UNAVAILABLE
        assert target_info_code(target, client) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        other = Tls(stranger.cert, stranger.key, user.ca, server_name=SERVER_NAME)
        assert target_info_code(target, other) == grpc.StatusCode.UNAVAILABLE
        # The actors' copies are the user's files, on whatever node each actor runs.
        assert {(path / "key.pem").read_bytes() for path in private_copies(before)} == {user.key.read_bytes()}
        assert stack.stop() == 0
    assert token_ids == expected
    error: Any = plaintext.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_an_unreadable_certificate_stops_ray_serve_before_any_actor(tmp_path: Path, llama_target: Path) -> None:
    directory = tmp_path / "user"
    directory.mkdir()
    user = make_certificates(directory)
    missing = tmp_path / "missing-ca.pem"
    tls = ["--tls-cert", str(user.cert), "--tls-key", str(user.key), "--tls-ca", str(missing)]
    result = run_to_exit(["serve", *RAY, "--target", str(llama_target), *tls, "--port", "0"], timeout_s=120)
    assert result.returncode == 2, result.stdout
    assert f"tandem serve: cannot start: --tls-ca {missing}: cannot be read" in result.stdout
    assert "starting a local Ray cluster" not in result.stdout and "Traceback" not in result.stdout
