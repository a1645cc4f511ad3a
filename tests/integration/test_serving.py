"""One running stack: bad input, cancellation, health and reflection, clean shutdown."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.grpc_util import channel_options
from tandem.settings import SERVICE_ENVIRONMENT
from tandem.wire import draft_pb2, orchestrator_pb2, orchestrator_pb2_grpc, target_pb2
from tests.integration.stack import Stack, draft_info, generate, serve, service_addresses, target_info

MAX_CONTEXT = 512  # TinyTargetSpec.max_position_embeddings
VOCAB = 320


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    with serve(llama_target, random_draft, "--speculative-num-steps", "3") as running:
        yield running


BAD_REQUESTS = [
    ({}, "prompt"),
    ({"input_ids": [5, VOCAB]}, f"input_ids[1]: {VOCAB}"),
    ({"input_ids": [-1, 5]}, "input_ids[0]: -1"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_p": -0.1}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "max_new_tokens": -1}, "max_new_tokens"),
    ({"input_ids": [5] * 10, "max_new_tokens": MAX_CONTEXT}, "max_new_tokens"),
    ({"input_ids": [5] * MAX_CONTEXT}, "prompt"),
    ({"prompt": "x", "stop": ["ok", ""]}, "stop[1]"),
]


@pytest.mark.parametrize(("fields", "names"), BAD_REQUESTS, ids=[names for _, names in BAD_REQUESTS])
def test_bad_input_is_invalid_argument(stack: Stack, fields: dict[str, object], names: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.address, **fields)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert error.details().startswith(names), error.details()  # type: ignore[attr-defined]


def test_bad_input_does_not_disturb_running_requests(stack: Stack) -> None:
    results: dict[str, object] = {}

    def good() -> None:
        results["good"] = generate(stack.address, prompt="def main():", max_new_tokens=40, ignore_eos=True)

    worker = threading.Thread(target=good)
    worker.start()
    for fields, _ in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            generate(stack.address, **fields)
    worker.join(timeout=120)
    completion = results["good"]
    assert completion.finish_reason == "length"  # type: ignore[attr-defined]
    assert len(completion.token_ids) == 40  # type: ignore[attr-defined]


def test_stop_string_and_eos(stack: Stack) -> None:
    full = generate(stack.address, prompt="def main():", max_new_tokens=30, ignore_eos=True)
    stop = full.text[5:8]
    stopped = generate(stack.address, prompt="def main():", max_new_tokens=30, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def wait_until_idle(addresses: dict[str, str]) -> tuple[target_pb2.TargetInfo, draft_pb2.DraftInfo]:
    """Target and draft info once neither holds a request. A finished request is released after its last message
    reaches the client, so an earlier test's request may still be held for a moment."""
    deadline = time.monotonic() + 30
    while True:
        target, draft = target_info(addresses["target"]), draft_info(addresses["draft"])
        if (target.running_requests, draft.running_requests) == (0, 0) or time.monotonic() > deadline:
            return target, draft
        time.sleep(0.1)


def test_cancel_frees_kv_on_target_and_draft(stack: Stack) -> None:
    addresses = service_addresses(stack.log)
    before, _ = wait_until_idle(addresses)
    assert before.running_requests == 0
    with grpc.insecure_channel(stack.address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = orchestrator_pb2.GenerateRequest(prompt="def main():", max_new_tokens=400, ignore_eos=True)
        call = stub.Generate(request)
        for _, _ in zip(range(3), call, strict=False):
            pass
        running = target_info(addresses["target"])
        assert running.running_requests == 1
        assert running.kv_blocks_free < before.kv_blocks_free
        call.cancel()
    target, draft = wait_until_idle(addresses)
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)


@pytest.mark.parametrize(
    ("service", "name"),
    [("orchestrator", "tandem.v1.Orchestrator"), ("target", "tandem.v1.Target"), ("draft", "tandem.v1.Draft")],
)
def test_health_and_reflection_on_every_server(stack: Stack, service: str, name: str) -> None:
    address = stack.address if service == "orchestrator" else service_addresses(stack.log)[service]
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {service.name for reply in replies for service in reply.list_services_response.service}
    assert {name, "grpc.health.v1.Health"} <= names


def test_sigterm_stops_every_process(llama_target: Path) -> None:
    with serve(llama_target, None) as target_only:
        assert generate(target_only.address, prompt="x", max_new_tokens=3).finish_reason in ("length", "eos")
        assert target_only.stop() == 0
    assert any("target stopping" in line for line in target_only.log)
    assert any("orchestrator stopping" in line for line in target_only.log)


def test_a_seed_gives_the_same_tokens_with_and_without_speculation(stack: Stack) -> None:
    # Seeded sampling is keyed by (seed, position) alone (tandem.sampling.verify, seeded_scores).
    def sample(seed: int, disable_speculation: bool = False) -> list[int]:
        completion = generate(
            stack.address,
            prompt="def main():",
            max_new_tokens=24,
            ignore_eos=True,
            temperature=0.9,
            top_p=0.95,
            top_k=50,
            seed=seed,
            disable_speculation=disable_speculation,
        )
        assert completion.finish_reason == "length" and len(completion.token_ids) == 24
        return completion.token_ids

    assert sample(11) == sample(11) == sample(11, disable_speculation=True)
    assert sample(12) == sample(12, disable_speculation=True) != sample(11)


def test_every_service_process_starts_with_the_service_environment(stack: Stack) -> None:
    """GOMP_SPINCOUNT must be in a service's environment before torch loads (tandem.settings.SERVICE_ENVIRONMENT):
    the launcher's children inherit it from `tandem serve`."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        if parent == stack.process.pid and b"launch.cli" in command:
            children[command[command.index(b"launch.cli") + 1].decode()] = environment
    assert set(children) == {"target", "draft", "orchestrator"}
    expected = os.environ.get("GOMP_SPINCOUNT", SERVICE_ENVIRONMENT["GOMP_SPINCOUNT"]).encode()
    for environment in children.values():
        assert b"GOMP_SPINCOUNT=" + expected in environment
