"""The one codec of a request's sampling options: tandem.sampling.params.SamplingParams <-> the wire's message.

Reading builds SamplingParams, which raises ValueError on values it cannot take; token ids are the receiver's to
check against its vocabulary.
"""

from __future__ import annotations

from tandem.sampling.params import SamplingParams
from tandem.wire import common_pb2


def sampling_to_proto(sampling: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,  # None leaves the optional field unset
        min_tokens=sampling.min_tokens,
        stop_token_ids=sampling.stop_token_ids,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias),
        grammar=sampling.grammar,
    )


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p or 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        grammar=message.grammar,
    )
