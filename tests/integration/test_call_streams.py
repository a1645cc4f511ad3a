"""The orchestrator's per-round calls ride long-lived bidirectional streams (orchestrator.grpc_backends.CallStream)
to a real `tandem target`: a failed call answers on the stream and the stream goes on; a dead peer is UNAVAILABLE."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from orchestrator.backends import BackendError, FailureKind, PrefillTask, VerifyTask
from orchestrator.grpc_backends import GrpcTarget
from tandem.grpc_util import channel_options
from tandem.sampling.params import SamplingParams
from tandem.wire import target_pb2, target_pb2_grpc
from tests.integration.stack import target_process


def test_verify_stream_outlives_a_failed_call_and_reports_a_dead_target(llama_target: Path, tmp_path: Path) -> None:
    with target_process(llama_target, 1, tmp_path / "ready") as target:

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(target.address, options=channel_options()) as channel:
                stub = target_pb2_grpc.TargetStub(channel)
                backend = GrpcTarget(stub)
                await backend.prefill([PrefillTask("a", [5, 6, 7], SamplingParams(), None)])
                first = await backend.verify([VerifyTask("a", [], 1)])
                stream = backend._verify._stream
                assert stream is not None

                with pytest.raises(BackendError) as caught:
                    await backend.verify([VerifyTask("missing", [8], 1)])
                assert caught.value.kind == FailureKind.INVALID
                assert str(caught.value) == (
                    "target verify: INVALID_ARGUMENT: request_id: 'missing' is not running on the target"
                )
                # The unary call fails the same way, with the same words.
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await stub.Verify(target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(request_id="missing")]))
                assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"target verify: INVALID_ARGUMENT: {unary.value.details()}" == str(caught.value)

                # Same stream, next call: the request goes on from where it was.
                second = await backend.verify([VerifyTask("a", [], 2)])
                assert backend._verify._stream is stream
                assert [r.request_id for r in first.results + second.results] == ["a", "a"]
                assert len(first.results[0].new_tokens) == len(second.results[0].new_tokens) == 1

                target.process.send_signal(signal.SIGKILL)
                target.process.wait(timeout=30)
                with pytest.raises(BackendError) as dead:
                    await backend.verify([VerifyTask("a", [], 3)])
                assert dead.value.kind == FailureKind.UNAVAILABLE
                assert str(dead.value).startswith("target verify: ")

        asyncio.run(scenario())
