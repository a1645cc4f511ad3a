"""TokenLogprob (tandem.sampling.logprobs) to and from its wire message, common.proto TokenLogprob."""

from __future__ import annotations

from collections.abc import Iterable

from tandem.sampling.logprobs import TokenLogprob
from tandem.wire import common_pb2


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top=[common_pb2.TopLogprob(token_id=token, logprob=logprob) for token, logprob in entry.top],
        )
        for entry in logprobs
    ]


def logprobs_from_proto(messages: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(message.token_id, message.logprob, tuple((top.token_id, top.logprob) for top in message.top))
        for message in messages
    ]
