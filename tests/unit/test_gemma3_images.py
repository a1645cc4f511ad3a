"""A Gemma 3 multimodal checkpoint's image prompts on the target: the image encoder's features at the placeholder
tokens, which see each other both ways in prefill (target_server.images, tandem.layers.page_table.chain_mask), give
transformers' greedy tokens for one and two images, in one chunk or several, and under drafts the target verifies."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers.page_table import chain_mask
from tandem.models.eagle3 import load_eagle3
from tandem.models.gemma3_vision import load_gemma3_image_encoder
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import ImageInput, OpenRequest, RequestError, RowStream, StepItem
from target_server.runner import TargetRunner
from tests.helpers.gemma4_checkpoints import VOCAB, write_gemma3_eagle3, write_tiny_gemma3_multimodal

BOI, EOI, IMAGE = VOCAB - 3, VOCAB - 2, VOCAB - 1
TOKENS_PER_IMAGE = 4
VISION = {"image_size": 56, "patch_size": 14, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48}
NEW_TOKENS = 8
CACHE = KVCacheSettings(num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-images"), seed=5, vision=VISION)


def pixel_values(count: int) -> torch.Tensor:
    generator = np.random.default_rng(count)
    images = [Image.fromarray(generator.integers(0, 256, (48, 64, 3), dtype=np.uint8)) for _ in range(count)]
    processor = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    values: torch.Tensor = processor(images=images, return_tensors="pt")["pixel_values"]
    return values


def prompt_with(count: int) -> list[int]:
    """BOS, text, then per image its tokens as the processor writes them (boi, the placeholders, eoi) and text."""
    prompt = [2, 40, 41, 42]
    for index in range(count):
        prompt += [BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI, 50 + index, 60 + index]
    return prompt


def reference(checkpoint: Path, prompt: list[int], pixels: torch.Tensor) -> list[int]:
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            pixel_values=pixels,
            token_type_ids=(ids == IMAGE).long(),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
        )
    return out[0, len(prompt) :].tolist()


def images_of(checkpoint: Path, prompt: list[int], pixels: torch.Tensor) -> tuple[ImageInput, ...]:
    with torch.no_grad():
        features = load_gemma3_image_encoder(checkpoint)(pixels)
    starts = [index for index, token in enumerate(prompt) if token == IMAGE and prompt[index - 1] == BOI]
    return tuple(
        ImageInput(start, image, hashlib.sha256(pixels[index].numpy().tobytes()).hexdigest())
        for index, (start, image) in enumerate(zip(starts, features, strict=True))
    )


def served(runner: TargetRunner, prompt: list[int], images: tuple[ImageInput, ...], chunks: list[int]) -> list[int]:
    """Greedy tokens after the prompt computed in chunks of these sizes, then plain decoding."""
    request = OpenRequest(prompt, SamplingParams(), images=images)
    tokens: list[int] = []
    for index, size in enumerate(chunks):
        item = StepItem("r", size, open=request if index == 0 else None)
        (result,) = runner.step([item])
        assert result.message == "", result.message
        tokens += result.new_tokens
    while len(tokens) < NEW_TOKENS:
        tokens += runner.verify("r").new_tokens
    runner.release(["r"])
    return tokens


@pytest.mark.parametrize("count", [1, 2])
def test_image_prompts_decode_as_transformers(checkpoint: Path, count: int) -> None:
    pixels = pixel_values(count)
    prompt = prompt_with(count)
    expected = reference(checkpoint, prompt, pixels)
    runner = TargetRunner(load_target(checkpoint), CACHE, max_context=128)
    images = images_of(checkpoint, prompt, pixels)
    assert served(runner, prompt, images, [len(prompt)]) == expected
    # In chunks ending just before and just after an image: each image is computed whole.
    first = images[0].start
    assert served(runner, prompt, images, [first, len(prompt) - first]) == expected
    assert served(runner, prompt, images, [first + TOKENS_PER_IMAGE, len(prompt) - first - 4]) == expected


def test_the_prefix_before_an_image_is_shared_and_its_blocks_only_with_the_same_image(checkpoint: Path) -> None:
    # A 12-token text prefix (3 blocks of 4), then an image at tokens 13..16: another image shares the 3 text blocks,
    # the same image all 5 full blocks (the 22nd token is computed for its logits).
    caching = replace(CACHE, prefix_caching=True)
    runner = TargetRunner(load_target(checkpoint), caching, max_context=128)
    prompt = [2, *range(40, 51), BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI, 70, 71, 72]  # 22 tokens
    pictures = {seed: pixel_values(seed)[:1] for seed in (1, 2)}
    images = {seed: images_of(checkpoint, prompt, pixels) for seed, pixels in pictures.items()}
    cached = {}
    for name, seed in (("first", 1), ("other image", 2), ("same image", 1)):
        request = OpenRequest(prompt, SamplingParams(), images=images[seed])
        (result,) = runner.step([StepItem(name, len(prompt), open=request)])
        assert result.message == "", result.message
        cached[name] = result.cached_tokens
        tokens = result.new_tokens
        while len(tokens) < NEW_TOKENS:
            tokens += runner.verify(name).new_tokens
        runner.release([name])
        assert tokens == reference(checkpoint, prompt, pictures[seed])
    assert cached == {"first": 0, "other image": 12, "same image": 20}


def test_drafts_after_an_image_prompt_are_verified(checkpoint: Path) -> None:
    pixels = pixel_values(1)
    prompt = prompt_with(1)
    expected = reference(checkpoint, prompt, pixels)
    runner = TargetRunner(load_target(checkpoint), CACHE, max_context=128)
    request = OpenRequest(prompt, SamplingParams(), images=images_of(checkpoint, prompt, pixels))
    (first,) = runner.step([StepItem("r", len(prompt), open=request)])
    result = runner.verify("r", [*expected[1:4], (expected[4] + 1) % VOCAB])  # three right, one wrong
    assert first.new_tokens == expected[:1] and (result.accepted, result.new_tokens) == (3, expected[1:5])


def test_a_chunk_ending_inside_an_image_is_refused(checkpoint: Path) -> None:
    pixels = pixel_values(1)
    prompt = prompt_with(1)
    runner = TargetRunner(load_target(checkpoint), CACHE, max_context=128)
    images = images_of(checkpoint, prompt, pixels)
    request = OpenRequest(prompt, SamplingParams(), images=images)
    (result,) = runner.step([StepItem("r", images[0].start + 2, open=request)])
    assert (
        result.message
        == "num_tokens: the chunk ends at prompt token 7, inside the image of tokens 5..8, which is computed whole"
    )
    assert runner.cache.num_free_blocks == CACHE.num_blocks and "r" not in runner.requests
    with pytest.raises(RequestError, match=r"images\[0\]: features 8 wide, the model's 64"):
        runner._only(
            StepItem(
                "r",
                len(prompt),
                open=OpenRequest(prompt, SamplingParams(), images=(ImageInput(5, torch.zeros(4, 8), "x"),)),
            )
        )


def test_an_image_run_is_seen_both_ways_inside_the_causal_triangle() -> None:
    assert chain_mask(4, False, []) is None and chain_mask(4, False, [(1, 2)]) is None  # one token: causal
    mask = chain_mask(5, False, [(1, 4)])
    assert mask is not None
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_an_eagle3_draft_takes_the_rows_of_an_image_prompt(checkpoint: Path, tmp_path: Path) -> None:
    # The target streams the hidden rows of every position, the image's included; the head embeds the placeholder
    # token there (vLLM's convention). Its drafts (a random head's) are verified: the output is the target's.
    draft, _ = load_eagle3(write_gemma3_eagle3(tmp_path, checkpoint))
    drafter = DraftRunner(draft, KVCacheSettings(num_blocks=64, block_size=4))
    pixels = pixel_values(2)
    prompt = prompt_with(2)
    runner = TargetRunner(load_target(checkpoint), CACHE, max_context=128)
    request = OpenRequest(prompt, SamplingParams(), images=images_of(checkpoint, prompt, pixels))
    (result,) = runner.step([StepItem("r", len(prompt), open=request, stream=RowStream((1, 2, 3)))])
    tokens, rounds = list(result.new_tokens), 0
    while len(tokens) < NEW_TOKENS:
        captured = result.captured
        assert captured is not None
        rows = TargetRows(captured.start_position, captured.next_tokens, captured.features)
        (proposal,) = drafter.propose([ProposeInput("r", rows, num_steps=3)])
        result = runner.verify("r", proposal)
        tokens += result.new_tokens
        rounds += 1
    assert tokens[:NEW_TOKENS] == reference(checkpoint, prompt, pixels) and rounds >= 2
    assert drafter.requests["r"].kv.length >= len(prompt)  # every prompt row went in, the image's too
