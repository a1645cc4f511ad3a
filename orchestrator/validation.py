"""Checking a public GenerateRequest and converting it to our own frozen dataclass, at the edge of the orchestrator.

Proto3 cannot tell an unset scalar from zero, so zero means "the default" where zero is not a useful value:
top_p 0 means 1.0 (no nucleus filtering), max_new_tokens 0 means the server default, seed 0 means no seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tandem.sampling.params import SamplingParams
from tandem.wire import orchestrator_pb2


class InvalidRequest(ValueError):
    """A request the server refuses; the message names the field and why, e.g. "top_p: must be in (0, 1], got 1.5"."""


@dataclass(frozen=True)
class Limits:
    """What the served models allow."""

    vocab_size: int  # the target model's vocabulary; ids in [0, vocab_size)
    max_context: int  # prompt and generated tokens together
    default_max_new_tokens: int = 128
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters of one stop string
    # Characters a prompt may have before it is tokenized: tokenizing costs time, so a prompt that could not fit the
    # context even at this many characters per token is refused unread.
    max_chars_per_token: int = 64


@dataclass(frozen=True)
class ValidatedRequest:
    input_ids: tuple[int, ...]
    max_new_tokens: int  # >= 1, and the prompt plus this many tokens fit in the context
    sampling: SamplingParams
    stop: tuple[str, ...]  # non-empty strings
    ignore_eos: bool
    disable_speculation: bool


def check_bounds(request: orchestrator_pb2.GenerateRequest, limits: Limits) -> None:
    """The checks that need no tokenizer, so that an oversized request costs nothing: counts and lengths."""
    if len(request.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"stop: {len(request.stop)} strings, at most {limits.max_stop_strings}")
    for index, stop_string in enumerate(request.stop):
        if len(stop_string) > limits.max_stop_length:
            raise InvalidRequest(f"stop[{index}]: {len(stop_string)} characters, at most {limits.max_stop_length}")
    max_chars = limits.max_context * limits.max_chars_per_token
    if len(request.prompt) > max_chars:
        raise InvalidRequest(
            f"prompt: {len(request.prompt)} characters cannot fit the context of {limits.max_context} tokens "
            f"(refused before tokenizing above {max_chars})"
        )
    if len(request.input_ids) >= limits.max_context:
        raise InvalidRequest(
            f"prompt: {len(request.input_ids)} tokens, the context holds {limits.max_context} "
            "(the prompt must leave room for at least one new token)"
        )


def validate_request(
    request: orchestrator_pb2.GenerateRequest, tokenizer: PreTrainedTokenizerBase, limits: Limits
) -> ValidatedRequest:
    """Returns the request as a ValidatedRequest, or raises InvalidRequest naming the first bad field.

    Call check_bounds first: this tokenizes.

    A non-empty prompt is tokenized (with the special tokens the tokenizer adds, such as BOS) and input_ids are
    ignored; otherwise input_ids are the prompt.
    """
    sampling = _validate_sampling(request)
    stop = tuple(request.stop)
    for index, stop_string in enumerate(stop):
        if not stop_string:
            raise InvalidRequest(f"stop[{index}]: must be a non-empty string")
    if request.max_new_tokens < 0:
        raise InvalidRequest(f"max_new_tokens: must be >= 0 (0 means the server default), got {request.max_new_tokens}")

    input_ids = _prompt_ids(request, tokenizer, limits.vocab_size)
    prompt_length = len(input_ids)
    if prompt_length >= limits.max_context:
        raise InvalidRequest(
            f"prompt: {prompt_length} tokens, the context holds {limits.max_context} "
            "(the prompt must leave room for at least one new token)"
        )
    room = limits.max_context - prompt_length
    if request.max_new_tokens == 0:
        max_new_tokens = min(limits.default_max_new_tokens, room)
    elif request.max_new_tokens > room:
        raise InvalidRequest(
            f"max_new_tokens: {request.max_new_tokens} new tokens after a {prompt_length}-token prompt exceed "
            f"the context of {limits.max_context} tokens (at most {room} fit)"
        )
    else:
        max_new_tokens = request.max_new_tokens

    return ValidatedRequest(
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=stop,
        ignore_eos=request.ignore_eos,
        disable_speculation=request.disable_speculation,
    )


def _validate_sampling(request: orchestrator_pb2.GenerateRequest) -> SamplingParams:
    temperature = request.temperature
    if not math.isfinite(temperature) or temperature < 0.0:
        raise InvalidRequest(f"temperature: must be a finite number >= 0 (0 means greedy), got {temperature}")
    top_p = 1.0 if request.top_p == 0.0 else request.top_p
    # Written so that NaN fails too: every comparison with NaN is false.
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"top_p: must be in (0, 1] (0 means 1), got {request.top_p}")
    if request.top_k < 0:
        raise InvalidRequest(f"top_k: must be >= 0 (0 disables it), got {request.top_k}")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=request.top_k,
        seed=None if request.seed == 0 else request.seed,
    )


def _prompt_ids(
    request: orchestrator_pb2.GenerateRequest, tokenizer: PreTrainedTokenizerBase, vocab_size: int
) -> tuple[int, ...]:
    if request.prompt:
        prompt_ids = tuple(tokenizer.encode(request.prompt, add_special_tokens=True))
        if not prompt_ids:
            raise InvalidRequest("prompt: the tokenizer turns it into no tokens")
        return prompt_ids
    if not request.input_ids:
        raise InvalidRequest("prompt: empty, and input_ids is empty too; give one of them")
    for index, token_id in enumerate(request.input_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"input_ids[{index}]: {token_id} is outside the vocabulary of {vocab_size} tokens [0, {vocab_size})"
            )
    return tuple(request.input_ids)
