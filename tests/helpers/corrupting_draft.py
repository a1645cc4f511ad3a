"""A draft replica gone wrong, for fault tests: a real gRPC Draft server in its own process that forwards every call
to a real replica and replaces the draft tokens it answers with ids outside the target's vocabulary.

    python -m tests.helpers.corrupting_draft --upstream HOST:PORT --vocab-size V --ready-file PATH
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from tandem.grpc_util import channel_options
from tandem.leases import session_metadata, session_of
from tandem.serving import ListenSettings, run_server
from tandem.wire import draft_pb2, draft_pb2_grpc


class CorruptingDraft(draft_pb2_grpc.DraftServicer):
    def __init__(self, upstream: draft_pb2_grpc.DraftStub, vocab_size: int) -> None:
        self.upstream = upstream
        self.vocab_size = vocab_size

    def corrupt(self, response: draft_pb2.ProposeResponse) -> draft_pb2.ProposeResponse:
        for result in response.results:
            result.drafts.tokens[:] = [self.vocab_size + 7] * len(result.drafts.tokens)
        return response

    async def GetInfo(self, request: draft_pb2.DraftInfoRequest, context: object) -> draft_pb2.DraftInfo:
        info: draft_pb2.DraftInfo = await self.upstream.GetInfo(request)
        return info

    async def Propose(self, request: draft_pb2.ProposeRequest, context: object) -> draft_pb2.ProposeResponse:
        return self.corrupt(await self.upstream.Propose(request))

    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeResponse]:
        upstream = self.upstream.ProposeStream(metadata=session_metadata(session_of(context.invocation_metadata())))
        async for request in requests:
            await upstream.write(request)
            yield self.corrupt(await upstream.read())
        await upstream.done_writing()

    async def Release(self, request: draft_pb2.DraftReleaseRequest, context: object) -> draft_pb2.DraftReleaseResponse:
        response: draft_pb2.DraftReleaseResponse = await self.upstream.Release(request)
        return response


async def main(upstream: str, vocab_size: int, listen: ListenSettings) -> None:
    async with grpc.aio.insecure_channel(upstream, options=channel_options()) as channel:
        service = CorruptingDraft(draft_pb2_grpc.DraftStub(channel), vocab_size)
        await run_server(
            "corrupting draft",
            lambda server: draft_pb2_grpc.add_DraftServicer_to_server(service, server),
            ["tandem.v1.Draft"],
            listen,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(main(args.upstream, args.vocab_size, ListenSettings(ready_file=Path(args.ready_file))))
