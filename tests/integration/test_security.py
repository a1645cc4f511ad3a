"""Security of real stacks: the API key on Generate, the admin port and its token, mutual TLS between services.

Two stacks, each started as a user starts it (`tandem serve`):
- `guarded`: --api-key-file, --admin-token-file, --max-draft-replicas 2 and --internal-tls (throwaway certificates
  for the services' own traffic, plaintext public port);
- `certified`: --tls-cert/--tls-key/--tls-ca with certificates made here (tandem.certificates) and --api-key-file:
  every service, the public port and the HTTP API serve TLS (HTTPS), the internal servers ask for client
  certificates, the public ones do not.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.auth import bearer_metadata
from tandem.certificates import CertificateFiles, make_certificates
from tandem.transport import Insecure, Tls, TransportSecurity
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc, target_pb2, target_pb2_grpc
from tests.integration.stack import Stack, serve, service_addresses, tandem_command

API_KEY = "test-api-key-8f2c"
ADMIN_TOKEN = "test-admin-token-51d9"
MAX_REPLICAS = 2


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "api-key").write_text(API_KEY + "\n")
    (secrets / "admin-token").write_text(ADMIN_TOKEN)
    extra = ["--api-key-file", str(secrets / "api-key"), "--admin-token-file", str(secrets / "admin-token")]
    extra += ["--max-draft-replicas", str(MAX_REPLICAS), "--internal-tls", "--speculative-num-steps", "3"]
    with serve(llama_target, random_draft, *extra) as stack:
        yield stack


def certificates(directory: Path) -> CertificateFiles:
    directory.mkdir()
    return make_certificates(directory)


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> CertificateFiles:
    return certificates(tmp_path_factory.mktemp("tls") / "ours")


@pytest.fixture(scope="module")
def certified(
    tmp_path_factory: pytest.TempPathFactory, llama_target: Path, random_draft: Path, ours: CertificateFiles
) -> Iterator[Stack]:
    key_file = tmp_path_factory.mktemp("certified-secrets") / "api-key"
    key_file.write_text(API_KEY)
    extra = ["--tls-cert", str(ours.cert), "--tls-key", str(ours.key), "--tls-ca", str(ours.ca)]
    extra += ["--api-key-file", str(key_file)]
    with serve(llama_target, random_draft, *extra, "--speculative-num-steps", "3") as stack:
        yield stack


def generate(address: str, security: TransportSecurity, key: str | None = None) -> str:
    """A short greedy completion through `security` with `key`; returns its finish reason."""
    request = orchestrator_pb2.GenerateRequest(prompt="def main():", max_new_tokens=8, ignore_eos=True)
    with security.channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        for response in stub.Generate(request, timeout=120, metadata=bearer_metadata(key)):
            if response.finish_reason:
                return response.finish_reason
    raise AssertionError("stream ended without a finish_reason")


def refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and details of the error that `call` must end with."""
    with pytest.raises(grpc.RpcError) as caught:
        call()
    error: Any = caught.value  # a grpc.Call as well: code() and details()
    return error.code(), error.details()


def admin_stub(channel: grpc.Channel) -> orchestrator_pb2_grpc.OrchestratorAdminStub:
    return orchestrator_pb2_grpc.OrchestratorAdminStub(channel)


def test_generate_needs_the_api_key(guarded: Stack) -> None:
    code, details = refusal(lambda: generate(guarded.address, Insecure()))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details.startswith("missing credentials"), details
    assert refusal(lambda: generate(guarded.address, Insecure(), "not-the-key")) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "authorization: the key is not valid",
    )
    assert generate(guarded.address, Insecure(), API_KEY) == "length"
    assert not any(API_KEY in line or ADMIN_TOKEN in line for line in guarded.log)  # never logged


def test_the_http_api_needs_the_api_key_and_echoes_the_request_id(guarded: Stack) -> None:
    assert guarded.http_url.startswith("http://"), guarded.http_url
    body = json.dumps({"prompt": "def f():", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"{guarded.http_url}/v1/completions", body, {"Content-Type": "application/json", "X-Request-Id": "trace-401"}
    )
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(request, timeout=60)
    assert missing.value.code == 401
    assert missing.value.headers["X-Request-Id"] == "trace-401"
    error = json.loads(missing.value.read())["error"]
    assert error["type"] == "authentication_error" and error["message"].startswith("missing credentials")

    wrong = openai.OpenAI(base_url=f"{guarded.http_url}/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(
            model="target", prompt="def f():", max_tokens=4, extra_headers={"X-Request-Id": "trace-401-wrong"}
        )
    assert caught.value.status_code == 401
    assert caught.value.response.headers["x-request-id"] == "trace-401-wrong"
    assert isinstance(caught.value.body, dict) and caught.value.body["message"] == "authorization: the key is not valid"

    client = openai.OpenAI(base_url=f"{guarded.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt="def f():", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    with urllib.request.urlopen(f"{guarded.http_url}/metrics", timeout=30) as response:  # open without a key
        assert b"vllm:num_requests_running" in response.read()


def test_health_answers_without_a_key(guarded: Stack) -> None:
    assert guarded.admin_address is not None
    for address in (guarded.address, guarded.admin_address):
        with grpc.insecure_channel(address) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_tandem_generate_sends_the_key_from_the_environment(guarded: Stack) -> None:
    command = tandem_command("generate", "def f():", "--address", guarded.address, "--max-new-tokens", "4")
    without = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert without.returncode == 1 and "UNAUTHENTICATED" in without.stderr
    environment = {**os.environ, "TANDEM_API_KEY": API_KEY}
    served = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert served.returncode == 0, served.stderr
    assert "finish_reason=length" in served.stdout


def test_admin_is_not_on_the_public_port(guarded: Stack) -> None:
    with grpc.insecure_channel(guarded.address) as channel:
        listing = orchestrator_pb2.ListReplicasRequest()
        code, _ = refusal(lambda: admin_stub(channel).ListReplicas(listing, metadata=bearer_metadata(API_KEY)))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert guarded.admin_address is not None and guarded.admin_address.startswith("127.0.0.1:")


def test_admin_needs_its_token_and_bounds_scale(guarded: Stack) -> None:
    assert guarded.admin_address is not None
    token = bearer_metadata(ADMIN_TOKEN)
    with grpc.insecure_channel(guarded.admin_address) as channel:
        admin = admin_stub(channel)
        listing = orchestrator_pb2.ListReplicasRequest()
        assert refusal(lambda: admin.ListReplicas(listing))[0] == grpc.StatusCode.UNAUTHENTICATED
        # The API key is not the admin token.
        code, _ = refusal(lambda: admin.ListReplicas(listing, metadata=bearer_metadata(API_KEY)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert [r.replica_id for r in admin.ListReplicas(listing, metadata=token).replicas] == ["draft-0"]

        too_many = orchestrator_pb2.ScaleRequest(draft_replicas=MAX_REPLICAS + 1)
        assert refusal(lambda: admin.Scale(too_many, metadata=token, timeout=60)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"draft_replicas: {MAX_REPLICAS + 1} is above --max-draft-replicas {MAX_REPLICAS}",
        )
        stranger = orchestrator_pb2.AddReplicaRequest(address="192.0.2.1:50062")
        code, details = refusal(lambda: admin.AddReplica(stranger, metadata=token, timeout=60))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "192.0.2.1:50062 is not allowed" in details
        assert len(admin.ListReplicas(listing, metadata=token).replicas) == 1


def test_tandem_scale_with_the_token_adds_a_replica_over_internal_tls(guarded: Stack) -> None:
    assert guarded.admin_address is not None
    command = tandem_command("scale", "--draft-replicas", "2", "--address", guarded.admin_address)
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    environment = {**os.environ, "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN}
    scaled = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    assert scaled.returncode == 0, scaled.stderr
    assert sorted(line.split("\t")[0] for line in scaled.stdout.splitlines()) == ["draft-0", "draft-1"]
    # The new replica pulled its hidden states from the target over mutual TLS and serves.
    assert generate(guarded.address, Insecure(), API_KEY) == "length"


def test_internal_tls_stack_refuses_plaintext_inside(guarded: Stack) -> None:
    target = service_addresses(guarded.log)["target"]
    with grpc.insecure_channel(target) as channel:
        code, _ = refusal(
            lambda: target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
        )
    assert code == grpc.StatusCode.UNAVAILABLE
    assert any("target serving on" in line and "(mutual TLS)" in line for line in guarded.log)


def target_info_code(address: str, security: TransportSecurity) -> grpc.StatusCode:
    with security.channel(address) as channel:
        try:
            target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
        except grpc.RpcError as error:
            failed: Any = error
            return failed.code()
    return grpc.StatusCode.OK


def test_mutual_tls_target_serves_only_clients_of_its_ca(
    certified: Stack, ours: CertificateFiles, tmp_path: Path
) -> None:
    theirs = certificates(tmp_path / "theirs")
    target = service_addresses(certified.log)["target"]
    assert target_info_code(target, Tls(ours.cert, ours.key, ours.ca)) == grpc.StatusCode.OK
    assert target_info_code(target, Insecure()) == grpc.StatusCode.UNAVAILABLE
    assert target_info_code(target, Tls(theirs.cert, theirs.key, ours.ca)) == grpc.StatusCode.UNAVAILABLE
    assert target_info_code(target, Tls(ca=ours.ca)) == grpc.StatusCode.UNAVAILABLE  # no client certificate


def test_public_tls_serves_generate_to_clients_without_certificates(certified: Stack, ours: CertificateFiles) -> None:
    assert generate(certified.address, Tls(ca=ours.ca), API_KEY) == "length"
    assert refusal(lambda: generate(certified.address, Tls(ca=ours.ca)))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert refusal(lambda: generate(certified.address, Insecure(), API_KEY))[0] == grpc.StatusCode.UNAVAILABLE


def https_client(url: str, ca: Path | None, key: str) -> openai.OpenAI:
    """The official client on `url`, trusting `ca` only (None: the system's roots), presenting no certificate."""
    verify = ssl.create_default_context(cafile=ca) if ca is not None else True
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key=key,
        max_retries=0,
        timeout=60,
        http_client=openai.DefaultHttpxClient(verify=verify),
    )


def test_public_tls_serves_the_http_api_over_https_with_the_api_key(certified: Stack, ours: CertificateFiles) -> None:
    # The public port's TLS covers the HTTP API: same certificate, no client certificate asked (the --tls-ca CA is
    # the services' own), the API key still required.
    assert certified.http_url.startswith("https://127.0.0.1:"), certified.http_url
    client = https_client(certified.http_url, ours.ca, API_KEY)
    model = client.models.list().data[0].id
    completion = client.completions.create(
        model=model, prompt="def f():", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    stream = client.completions.create(
        model=model,
        prompt="def f():",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == completion.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    with pytest.raises(openai.AuthenticationError) as refused:
        https_client(certified.http_url, ours.ca, "not-the-key").completions.create(model=model, prompt="x")
    assert refused.value.status_code == 401
    trusting = ssl.create_default_context(cafile=ours.ca)
    body = json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).encode()
    keyless = urllib.request.Request(f"{certified.http_url}/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(keyless, timeout=60, context=trusting)
    assert missing.value.code == 401

    # Probes and scrapers on the same port speak HTTPS too, without a key.
    with urllib.request.urlopen(f"{certified.http_url}/health", timeout=30, context=trusting) as response:
        assert response.read() == b"ok"
    with urllib.request.urlopen(f"{certified.http_url}/metrics", timeout=30, context=trusting) as response:
        assert b"vllm:generation_tokens" in response.read()
    assert not any(API_KEY in line for line in certified.log)


def test_the_https_port_answers_no_plain_http_and_presents_its_certificate(
    certified: Stack, ours: CertificateFiles, tmp_path: Path
) -> None:
    plain_url = certified.http_url.replace("https://", "http://", 1)
    with pytest.raises(openai.APIConnectionError):  # the key was sent in the clear, and nothing answered it
        https_client(plain_url, None, API_KEY).models.list()
    with pytest.raises((OSError, http.client.HTTPException)):  # the connection ends without an answer
        urllib.request.urlopen(f"{plain_url}/health", timeout=30)
    # A client trusting another CA (or only the system's roots) refuses the server's certificate.
    theirs = certificates(tmp_path / "theirs")
    for ca in (theirs.ca, None):
        with pytest.raises(openai.APIConnectionError) as refused:
            https_client(certified.http_url, ca, API_KEY).models.list()
        assert "CERTIFICATE_VERIFY_FAILED" in repr(refused.value.__cause__), repr(refused.value.__cause__)
