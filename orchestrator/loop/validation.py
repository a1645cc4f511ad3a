"""Checking a public GenerateRequest and converting it to our own frozen dataclass, at the edge of the orchestrator.

Proto3 cannot tell an unset scalar from zero, so zero means "the default" where zero is not a useful value:
top_p 0 means 1.0 (no nucleus filtering), max_new_tokens 0 means the server default. `seed` has presence (proto3
`optional`): unset means no seed, and 0 is a seed like any other.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from orchestrator.loop.prompt_images import ImageLayout, prompt_images
from orchestrator.loop.structured import grammar_of, refused_resume
from orchestrator.peers.backends import PromptImage
from tandem.sampling.logprobs import MAX_TOP_LOGPROBS
from tandem.sampling.params import SamplingParams
from tandem.wire import orchestrator_pb2

MAX_CLIENT_REQUEST_ID = 128  # characters of a client's request id
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties
MAX_REPETITION_PENALTY = 100.0  # far beyond any useful value; a bound keeps the logits finite
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit bias


class InvalidRequest(ValueError):
    """A request the server refuses; the message names the field and why, e.g. "top_p: must be in (0, 1], got 1.5"."""

    @property
    def field(self) -> str:
        """The field the message names (its text before the first colon), e.g. "top_p" or "stop[1]"."""
        return str(self).split(":", 1)[0]


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
    images: ImageLayout | None = None  # how the target's prompts hold images; None: it serves none


@dataclass(frozen=True)
class ValidatedRequest:
    input_ids: tuple[int, ...]
    max_new_tokens: int  # >= 1, and the prompt plus this many tokens fit in the context
    sampling: SamplingParams
    stop: tuple[str, ...]  # non-empty strings
    ignore_eos: bool
    disable_speculation: bool
    stop_token_ids: frozenset[int] = frozenset()  # any of these ends the request ("stop"), ignore_eos or not
    top_logprobs: int | None = None  # with logprobs: how many best tokens per position; None: no logprobs
    cache_salt: str = ""  # prefix-cache blocks are shared only between requests of the same salt
    resumed: tuple[int, ...] = ()  # tokens a broken stream of the request sent already (resume_token_ids)
    images: tuple[PromptImage, ...] = ()  # in prompt order; each one's digest names its blocks (marks)

    @property
    def marks(self) -> tuple[tuple[int, str], ...]:
        """Its images' (first token, digest): prefix-cache blocks from an image's on are named by its content."""
        return tuple((image.start, image.digest) for image in self.images)


def check_bounds(request: orchestrator_pb2.GenerateRequest, limits: Limits) -> None:
    """The checks that need no tokenizer, so that an oversized request costs nothing: counts and lengths."""
    if len(request.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"stop: {len(request.stop)} strings, at most {limits.max_stop_strings}")
    for index, stop_string in enumerate(request.stop):
        if len(stop_string) > limits.max_stop_length:
            raise InvalidRequest(f"stop[{index}]: {len(stop_string)} characters, at most {limits.max_stop_length}")
    limit = limits.images.limit if limits.images is not None else 0
    if len(request.images) > limit:
        served = f"at most {limit} in one prompt" if limit else "the target serves no images"
        raise InvalidRequest(f"images: {len(request.images)} sent, {served} (--limit-mm-per-prompt)")
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

    _check_token_ids(request, limits.vocab_size)
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
    if not 0 <= request.min_tokens <= max_new_tokens:
        raise InvalidRequest(f"min_tokens: must be in [0, max_new_tokens = {max_new_tokens}], got {request.min_tokens}")
    resumed = _resumed(request, max_new_tokens, limits.vocab_size)
    refused = refused_resume(sampling.grammar, resumed, tokenizer)
    if refused:
        raise InvalidRequest(f"resume_token_ids{refused}")
    try:
        images = prompt_images(input_ids, request.images, limits.images)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None
    return ValidatedRequest(
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=stop,
        ignore_eos=request.ignore_eos,
        disable_speculation=request.disable_speculation,
        stop_token_ids=frozenset(request.stop_token_ids),
        top_logprobs=_top_logprobs(request),
        cache_salt=request.cache_salt,
        resumed=resumed,
        images=images,
    )


def _resumed(request: orchestrator_pb2.GenerateRequest, max_new_tokens: int, vocab_size: int) -> tuple[int, ...]:
    """The tokens a resumed request's stream sent already: ids of the vocabulary, no more than it may generate."""
    resumed = tuple(request.resume_token_ids)
    if len(resumed) > max_new_tokens:
        raise InvalidRequest(
            f"resume_token_ids: {len(resumed)} tokens, more than the request's max_new_tokens = {max_new_tokens}"
        )
    for index, token_id in enumerate(resumed):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"resume_token_ids[{index}]: {token_id} is outside the vocabulary of {vocab_size} tokens"
            )
    return resumed


def _check_token_ids(request: orchestrator_pb2.GenerateRequest, vocab_size: int) -> None:
    """The ids of stop_token_ids and logit_bias are the vocabulary's; the biases within OpenAI's bounds."""
    for index, token_id in enumerate(request.stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"stop_token_ids[{index}]: {token_id} is outside the vocabulary of {vocab_size} tokens"
            )
    for token_id, bias in sorted(request.logit_bias.items()):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"logit_bias: {token_id} is outside the vocabulary of {vocab_size} tokens")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias[{token_id}]: must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}"
            )


def _top_logprobs(request: orchestrator_pb2.GenerateRequest) -> int | None:
    if not request.logprobs:
        if request.top_logprobs:
            raise InvalidRequest(f"top_logprobs: {request.top_logprobs} needs logprobs set")
        return None
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
    return request.top_logprobs


def with_stop_masking(params: ValidatedRequest, eos_token_ids: frozenset[int]) -> ValidatedRequest:
    """The request with the ids its target must mask until min_tokens: every id that would end it (EOS unless
    ignore_eos, and its stop_token_ids)."""
    if params.sampling.min_tokens == 0:
        return params
    ending = params.stop_token_ids | (frozenset() if params.ignore_eos else eos_token_ids)
    return replace(params, sampling=replace(params.sampling, stop_token_ids=tuple(sorted(ending))))


def client_request_id(value: str | None) -> str:
    """The id a client gave its request (HTTP header X-Request-Id, gRPC metadata x-request-id), or a new uuid when it
    gave none; it names the request in logs and answers, beside the internal id. Printable ASCII without spaces."""
    if value is None:
        return uuid.uuid4().hex
    if not 0 < len(value) <= MAX_CLIENT_REQUEST_ID or not all("!" <= char <= "~" for char in value):
        raise InvalidRequest(
            f"x-request-id: must be 1 to {MAX_CLIENT_REQUEST_ID} printable ASCII characters without spaces, "
            f"got {value[:MAX_CLIENT_REQUEST_ID]!r}"
        )
    return value


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
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequest(f"{name}: must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
    repetition = 1.0 if request.repetition_penalty == 0.0 else request.repetition_penalty
    if not 0.0 < repetition <= MAX_REPETITION_PENALTY:
        raise InvalidRequest(
            f"repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY}] (1 or 0: none), "
            f"got {request.repetition_penalty}"
        )
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=request.top_k,
        seed=request.seed if request.HasField("seed") else None,
        min_tokens=max(0, request.min_tokens),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=repetition,
        logit_bias=tuple(sorted(request.logit_bias.items())),
        grammar=_grammar(request),
    )


def _grammar(request: orchestrator_pb2.GenerateRequest) -> str:
    try:
        return grammar_of(request)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None


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
