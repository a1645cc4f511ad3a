"""The orchestrator's per-round calls ride long-lived bidirectional streams
(orchestrator.peers.grpc_backends.CallStream) to a real `tandem target`: a failed call answers on the stream and the
stream goes on; a dead peer is UNAVAILABLE."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from orchestrator.peers.backends import BackendError, FailureKind, OpenRequest, StepItem
from orchestrator.peers.grpc_backends import GrpcTarget
from tandem.grpc_util import channel_options
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.wire import target_pb2, target_pb2_grpc
from tests.integration.stack import target_process


def test_step_stream_fails_items_alone_and_reports_a_dead_target(llama_target: Path, tmp_path: Path) -> None:
    with target_process(llama_target, 1, tmp_path / "ready") as target:

        async def scenario() -> None:
            async with grpc.aio.insecure_channel(target.address, options=channel_options()) as channel:
                stub = target_pb2_grpc.TargetStub(channel)
                backend = GrpcTarget(stub, timeout_s=60.0)
                opened = await backend.step([StepItem("a", 1, 3, open=OpenRequest([5, 6, 7], SamplingParams()))], [])
                assert opened.results[0].failure is None and len(opened.results[0].new_tokens) == 1
                stream = backend._step._stream
                assert stream is not None

                # A wrong item fails alone: the other item of the same step goes on.
                mixed = await backend.step([StepItem("missing", 1, 1, DraftTree.chain([8])), StepItem("a", 2, 1)], [])
                failure = mixed.results[0].failure
                assert failure is not None and failure.kind == FailureKind.INVALID
                assert str(failure) == "target: INVALID_ARGUMENT: request_id: 'missing' is not running on the target"
                assert mixed.results[1].failure is None and len(mixed.results[1].new_tokens) == 1
                # The unary call answers the same item the same way.
                unary = await stub.Step(target_pb2.StepRequest(items=[target_pb2.StepItem(request_id="missing")]))
                assert unary.results[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]

                # Same stream, next call: the request goes on from where it was.
                third = await backend.step([StepItem("a", 3, 1)], [])
                assert backend._step._stream is stream
                assert third.results[0].failure is None and len(third.results[0].new_tokens) == 1

                # A stream that ended while idle (here cancelled; a closed connection does the same) is replaced
                # by a new one at the next call instead of failing it.
                stream.cancel()
                await asyncio.sleep(0.1)
                assert stream.done()
                fourth = await backend.step([StepItem("a", 4, 1)], [])
                assert fourth.results[0].failure is None and len(fourth.results[0].new_tokens) == 1
                assert backend._step._stream is not stream

                target.process.send_signal(signal.SIGKILL)
                target.process.wait(timeout=30)
                with pytest.raises(BackendError) as dead:
                    await backend.step([StepItem("a", 5, 1)], [])
                assert dead.value.kind == FailureKind.UNAVAILABLE
                assert str(dead.value).startswith("target step: ")

        asyncio.run(scenario())
