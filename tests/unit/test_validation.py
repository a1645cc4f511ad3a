"""Validation of the public GenerateRequest: proto3 defaults, and one test per refusal with its message."""

from __future__ import annotations

import hashlib
import io
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.prompt_images import ImageLayout
from orchestrator.loop.validation import (
    InvalidRequest,
    Limits,
    ValidatedRequest,
    check_bounds,
    client_request_id,
    validate_request,
    with_stop_masking,
)
from orchestrator.peers.backends import PromptImage
from tandem.models.image_prompt import FixedCount, ImagePrompt, PatchBudget
from tandem.sampling.params import SamplingParams
from tandem.wire.orchestrator_pb2 import GenerateRequest
from tests.helpers.tokenizer import write_tokenizer

LIMITS = Limits(vocab_size=320, max_context=64, default_max_new_tokens=16)


@pytest.fixture
def tokenizer(tmp_path: Path) -> PreTrainedTokenizerBase:
    write_tokenizer(tmp_path, LIMITS.vocab_size)
    return AutoTokenizer.from_pretrained(tmp_path)


def validate(tokenizer: PreTrainedTokenizerBase, request: GenerateRequest) -> ValidatedRequest:
    return validate_request(request, tokenizer, LIMITS)


def assert_refused(tokenizer: PreTrainedTokenizerBase, request: GenerateRequest, message: str) -> None:
    """The request is refused with a message that starts with the given one."""
    with pytest.raises(InvalidRequest, match=f"^{re.escape(message)}"):
        validate(tokenizer, request)


# Accepted requests


def test_unset_fields_take_their_defaults(tokenizer: PreTrainedTokenizerBase) -> None:
    request = validate(tokenizer, GenerateRequest(input_ids=[5, 6, 7]))
    assert request == ValidatedRequest(
        input_ids=(5, 6, 7),
        max_new_tokens=LIMITS.default_max_new_tokens,
        sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=None),
        stop=(),
        ignore_eos=False,
        disable_speculation=False,
    )


def test_set_fields_are_carried_over(tokenizer: PreTrainedTokenizerBase) -> None:
    request = GenerateRequest(
        input_ids=[0, 319],
        max_new_tokens=62,
        temperature=0.5,
        top_p=0.25,
        top_k=40,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
        ignore_eos=True,
        disable_speculation=True,
    )
    assert validate(tokenizer, request) == ValidatedRequest(
        input_ids=(0, 319),
        max_new_tokens=62,
        sampling=SamplingParams(temperature=0.5, top_p=0.25, top_k=40, seed=2**64 - 1),
        stop=("\n\n", "END"),
        ignore_eos=True,
        disable_speculation=True,
    )


def test_seed_zero_is_a_seed_and_stop_token_ids_are_carried(tokenizer: PreTrainedTokenizerBase) -> None:
    request = validate(tokenizer, GenerateRequest(input_ids=[5], seed=0, stop_token_ids=[7, 9, 7]))
    assert request.sampling.seed == 0
    assert request.stop_token_ids == frozenset({7, 9})
    assert validate(tokenizer, GenerateRequest(input_ids=[5])).sampling.seed is None


def test_stop_token_id_outside_the_vocabulary_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], stop_token_ids=[3, 320]), "stop_token_ids[1]: 320")


def test_prompt_is_tokenized_and_input_ids_are_ignored(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "def add(a, b):\n    return a + b"
    request = validate(tokenizer, GenerateRequest(prompt=prompt, input_ids=[999, -1]))
    assert request.input_ids == tuple(tokenizer.encode(prompt))
    assert tokenizer.decode(list(request.input_ids)) == prompt


def test_default_max_new_tokens_shrinks_to_the_room_left_in_the_context(tokenizer: PreTrainedTokenizerBase) -> None:
    assert validate(tokenizer, GenerateRequest(input_ids=[5] * 50)).max_new_tokens == 14
    assert validate(tokenizer, GenerateRequest(input_ids=[5] * 63)).max_new_tokens == 1


def test_prompt_and_new_tokens_may_fill_the_context_exactly(tokenizer: PreTrainedTokenizerBase) -> None:
    assert validate(tokenizer, GenerateRequest(input_ids=[5] * 60, max_new_tokens=4)).max_new_tokens == 4


# Refused requests


def test_empty_prompt_without_input_ids_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(tokenizer, GenerateRequest(), "prompt: empty, and input_ids is empty too")


@pytest.mark.parametrize("bad_id", [-1, 320, 2**31 - 1])
def test_input_id_outside_the_vocabulary_is_refused(tokenizer: PreTrainedTokenizerBase, bad_id: int) -> None:
    assert_refused(
        tokenizer,
        GenerateRequest(input_ids=[5, 6, bad_id, 7]),
        f"input_ids[2]: {bad_id} is outside the vocabulary of 320 tokens [0, 320)",
    )


@pytest.mark.parametrize("temperature", [-0.5, math.inf, math.nan])
def test_negative_or_infinite_temperature_is_refused(tokenizer: PreTrainedTokenizerBase, temperature: float) -> None:
    assert_refused(
        tokenizer,
        GenerateRequest(input_ids=[5], temperature=temperature),
        f"temperature: must be a finite number >= 0 (0 means greedy), got {temperature}",
    )


@pytest.mark.parametrize("top_p", [1.5, -0.25, math.nan])
def test_top_p_outside_zero_to_one_is_refused(tokenizer: PreTrainedTokenizerBase, top_p: float) -> None:
    assert_refused(
        tokenizer, GenerateRequest(input_ids=[5], top_p=top_p), f"top_p: must be in (0, 1] (0 means 1), got {top_p}"
    )


def test_negative_top_k_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], top_k=-3), "top_k: must be >= 0 (0 disables it), got -3")


def test_negative_max_new_tokens_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(
        tokenizer,
        GenerateRequest(input_ids=[5], max_new_tokens=-1),
        "max_new_tokens: must be >= 0 (0 means the server default), got -1",
    )


@pytest.mark.parametrize("prompt_length", [64, 100])
def test_prompt_filling_the_context_is_refused(tokenizer: PreTrainedTokenizerBase, prompt_length: int) -> None:
    assert_refused(
        tokenizer,
        GenerateRequest(input_ids=[5] * prompt_length),
        f"prompt: {prompt_length} tokens, the context holds 64",
    )


def test_tokenized_prompt_filling_the_context_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    prompt_length = len(tokenizer.encode(prompt))
    assert prompt_length >= LIMITS.max_context
    assert_refused(tokenizer, GenerateRequest(prompt=prompt), f"prompt: {prompt_length} tokens, the context holds 64")


def test_new_tokens_overflowing_the_context_are_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(
        tokenizer,
        GenerateRequest(input_ids=[5] * 60, max_new_tokens=5),
        "max_new_tokens: 5 new tokens after a 60-token prompt exceed the context of 64 tokens (at most 4 fit)",
    )


def test_empty_stop_string_is_refused(tokenizer: PreTrainedTokenizerBase) -> None:
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], stop=["END", ""]), "stop[1]: must be a non-empty string")


def test_logprobs_and_their_bounds(tokenizer: PreTrainedTokenizerBase) -> None:
    assert validate(tokenizer, GenerateRequest(input_ids=[5])).top_logprobs is None
    assert validate(tokenizer, GenerateRequest(input_ids=[5], logprobs=True)).top_logprobs == 0
    assert validate(tokenizer, GenerateRequest(input_ids=[5], logprobs=True, top_logprobs=20)).top_logprobs == 20
    assert_refused(
        tokenizer, GenerateRequest(input_ids=[5], logprobs=True, top_logprobs=21), "top_logprobs: must be in"
    )
    assert_refused(
        tokenizer, GenerateRequest(input_ids=[5], logprobs=True, top_logprobs=-1), "top_logprobs: must be in"
    )
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], top_logprobs=2), "top_logprobs: 2 needs logprobs")


def test_min_tokens_is_bounded_by_max_new_tokens_and_masks_what_would_end(tokenizer: PreTrainedTokenizerBase) -> None:
    request = validate(tokenizer, GenerateRequest(input_ids=[5], max_new_tokens=8, min_tokens=8, stop_token_ids=[9]))
    assert request.sampling.min_tokens == 8
    assert with_stop_masking(request, frozenset({2, 3})).sampling.stop_token_ids == (2, 3, 9)
    ignoring = validate(tokenizer, GenerateRequest(input_ids=[5], min_tokens=1, ignore_eos=True, stop_token_ids=[9]))
    assert with_stop_masking(ignoring, frozenset({2})).sampling.stop_token_ids == (9,)
    without = validate(tokenizer, GenerateRequest(input_ids=[5], stop_token_ids=[9]))
    assert with_stop_masking(without, frozenset({2})) is without
    too_many = GenerateRequest(input_ids=[5], max_new_tokens=8, min_tokens=9)
    assert_refused(tokenizer, too_many, "min_tokens: must be in [0, max_new_tokens = 8], got 9")
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], min_tokens=-1), "min_tokens: must be in")


def test_client_request_ids() -> None:
    assert client_request_id("trace-1:a") == "trace-1:a"
    generated = client_request_id(None)
    assert len(generated) == 32 and generated != client_request_id(None)
    for bad in ("", "has space", "x" * 129, "caf\u00e9", "line\nbreak"):
        with pytest.raises(InvalidRequest, match=r"^x-request-id: "):
            client_request_id(bad)


def test_penalties_and_logit_bias_are_carried_over(tokenizer: PreTrainedTokenizerBase) -> None:
    request = GenerateRequest(
        input_ids=[5], presence_penalty=1.5, frequency_penalty=-2.0, repetition_penalty=1.25, logit_bias={9: -100, 3: 4}
    )
    sampling = validate(tokenizer, request).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (1.5, -2.0, 1.25)
    assert sampling.logit_bias == ((3, 4.0), (9, -100.0))
    assert validate(tokenizer, GenerateRequest(input_ids=[5])).sampling.repetition_penalty == 1.0  # 0: unset


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty: must be in [-2.0, 2.0], got 2.5"),
        ({"frequency_penalty": math.nan}, "frequency_penalty: must be in [-2.0, 2.0]"),
        ({"repetition_penalty": -1.0}, "repetition_penalty: must be in (0, 100.0]"),
        ({"logit_bias": {320: 1.0}}, "logit_bias: 320 is outside the vocabulary of 320 tokens"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5]: must be in [-100.0, 100.0], got 101.0"),
    ],
)
def test_penalties_and_biases_out_of_range_are_refused(
    tokenizer: PreTrainedTokenizerBase, fields: dict[str, Any], message: str
) -> None:
    assert_refused(tokenizer, GenerateRequest(input_ids=[5], **fields), message)


def png(height: int, width: int) -> bytes:
    data = io.BytesIO()
    Image.new("RGB", (width, height), (height, width, 7)).save(data, format="PNG")
    return data.getvalue()


def test_images_fill_their_placeholder_runs_in_order_and_salt_the_cache(tokenizer: PreTrainedTokenizerBase) -> None:
    # A target announcing begin 300, two placeholders of id 302, end 301, at most 2 images a prompt.
    limits = replace(LIMITS, images=ImageLayout(2, ImagePrompt(300, 302, 300, 301, "", FixedCount(2))))
    prompt = [5, 300, 302, 302, 301, 6, 300, 302, 302, 301, 7]
    one, two = png(4, 6), png(9, 3)
    request = GenerateRequest(input_ids=prompt, images=[one, two], cache_salt="s")
    validated = validate_request(request, tokenizer, limits)
    digests = [hashlib.sha256(data).hexdigest() for data in (one, two)]
    assert validated.images == (PromptImage(2, 4, one, digests[0]), PromptImage(7, 9, two, digests[1]))
    assert validated.cache_salt == "s" and validated.marks == ((2, digests[0]), (7, digests[1]))
    for images, message in [
        ([one], "images: 1 sent for a prompt holding 2 image placeholder runs"),
        ([], "images: 0 sent for a prompt holding 2 image placeholder runs"),
        ([one, one, two], "images: 3 in one prompt, at most 2 (--limit-mm-per-prompt)"),
        ([one, b"two"], "images[1]: 3 bytes that are not an image Pillow reads"),
    ]:
        with pytest.raises(InvalidRequest, match=f"^{re.escape(message)}"):
            validate_request(GenerateRequest(input_ids=prompt, images=images), tokenizer, limits)
    short = GenerateRequest(input_ids=[5, 300, 302, 301], images=[one])
    with pytest.raises(InvalidRequest, match=r"^prompt: a run of 1 image placeholder tokens \(id 302\) at token 2"):
        validate_request(short, tokenizer, limits)


def test_each_image_takes_the_placeholders_its_size_does(tokenizer: PreTrainedTokenizerBase) -> None:
    # Kimi-K2.5's rule with 2-pixel patches, one placeholder a patch: a 2 x 4 image takes 2, a 4 x 4 one 4.
    budget = PatchBudget(patch_size=2, merge_size=1, max_patches=100, max_side=100)
    limits = replace(LIMITS, images=ImageLayout(2, ImagePrompt(302, 302, None, None, "", budget)))
    prompt = [5, 302, 302, 6, 302, 302, 302, 302, 7]
    small, square = png(2, 4), png(4, 4)
    assert len(validate_request(GenerateRequest(input_ids=prompt, images=[small, square]), tokenizer, limits).images)
    swapped = GenerateRequest(input_ids=prompt, images=[square, small])
    with pytest.raises(InvalidRequest, match=r"^prompt: a run of 2 image .* at token 1; images\[0\] takes 4"):
        validate_request(swapped, tokenizer, limits)

    # A target serving no images refuses them before anything is read.
    with pytest.raises(InvalidRequest, match=r"^images: 1 sent, the target serves no images"):
        check_bounds(GenerateRequest(input_ids=[5], images=[b"one"]), LIMITS)
    with pytest.raises(InvalidRequest, match=r"^images: 3 sent, at most 2 in one prompt"):
        check_bounds(GenerateRequest(input_ids=[5], images=[b"1", b"2", b"3"]), limits)
