"""Gemma 4 and Kimi-K2.5 image prompts on the target: the image encoder's features from an image's bytes at the
placeholders give transformers' greedy tokens for one and two images, in one chunk or several. Gemma 4's image tokens
see each other both ways on sliding layers only, where the config says "vision" (and causally where it does not);
Kimi-K2.5's attend causally; Gemma 4's per-layer inputs at an image's tokens are the pad token's."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoImageProcessor, Gemma4ForConditionalGeneration, Kimi_K25ForConditionalGeneration

from tandem.models.image_encoder import LocalImageEncoder, image_encoder_for
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import ImageInput, OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.deepseek_checkpoints import TinyDeepseekSpec
from tests.helpers.gemma4_checkpoints import SPECS, VOCAB, write_tiny_gemma4_multimodal
from tests.helpers.images import opened, png
from tests.helpers.kimi_checkpoints import KIMI_PROCESSING, to_hub_layout, write_tiny_kimi_k25

NEW_TOKENS = 8
CACHE = KVCacheSettings(num_blocks=128, block_size=4)
SIZES = ((40, 70), (90, 30))  # (height, width): Gemma 4 gives 66 and 56 tokens, Kimi-K2.5 12 and 8


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The dense spec with images seen both ways on sliding layers ("vision"), and with the default (causal)."""
    vision = SPECS["dense"].__class__(extra={"use_bidirectional_attention": "vision"})
    root = tmp_path_factory.mktemp("gemma4-images")
    return {
        "vision": write_tiny_gemma4_multimodal(root / "vision", vision),
        "causal": write_tiny_gemma4_multimodal(root / "causal", SPECS["dense"]),
    }


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.models.kimi_image_processor import KimiImageProcessor

    root = tmp_path_factory.mktemp("kimi-images")
    written = write_tiny_kimi_k25(root / "transformers", TinyDeepseekSpec(num_layers=2))
    hub = to_hub_layout(Path(shutil.copytree(written, root / "hub")))
    for directory in (written, hub):
        KimiImageProcessor(**KIMI_PROCESSING).save_pretrained(directory)
    return root


def prompt_with(encoder: LocalImageEncoder, images: list[bytes]) -> list[int]:
    """BOS, text, then per image its tokens as the processor writes them, and text."""
    prompt = [2, 40, 41, 42]
    for index, data in enumerate(images):
        prompt += [*encoder.prompt.expansion(encoder.prompt.tokens(*opened(data).size[::-1])), 50 + index, 60 + index]
    return prompt


def served(runner: TargetRunner, prompt: list[int], images: tuple[ImageInput, ...], chunks: list[int]) -> list[int]:
    """Greedy tokens after the prompt computed in chunks of these sizes, then plain decoding."""
    request = OpenRequest(prompt, SamplingParams(), images=images)
    tokens: list[int] = []
    for index, size in enumerate(chunks):
        (result,) = runner.step([StepItem("r", size, open=request if index == 0 else None)])
        assert result.message == "", result.message
        tokens += result.new_tokens
    while len(tokens) < NEW_TOKENS:
        tokens += runner.verify("r").new_tokens
    runner.release(["r"])
    return tokens[:NEW_TOKENS]


def check_served(checkpoint: Path, count: int, reference: Callable[[list[int], list[bytes]], list[int]]) -> None:
    encoder = image_encoder_for(checkpoint, torch.float32, "cpu")
    assert encoder is not None
    images = [png(*size, seed=seed) for seed, size in enumerate(SIZES[:count])]
    prompt = prompt_with(encoder, images)
    expected = reference(prompt, images)
    image_id = encoder.prompt.image_token_id
    starts = [index for index, token in enumerate(prompt) if token == image_id and prompt[index - 1] != image_id]
    inputs = tuple(ImageInput(start, *encoder.features(data)[::-1]) for start, data in zip(starts, images, strict=True))
    runner = TargetRunner(load_target(checkpoint), CACHE, max_context=256)
    assert served(runner, prompt, inputs, [len(prompt)]) == expected
    # In chunks that end just before the first image and just after it.
    first, after = inputs[0].start, inputs[0].start + len(inputs[0].features) + 1
    assert served(runner, prompt, inputs, [first, after - first, len(prompt) - after]) == expected


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("attention", ["vision", "causal"])
def test_gemma4_image_prompts_decode_as_transformers(gemma4: dict[str, Path], attention: str, count: int) -> None:
    checkpoint = gemma4[attention]
    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def reference(prompt: list[int], images: list[bytes]) -> list[int]:
        inputs = processor(images=[opened(data) for data in images], return_tensors="pt")
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids,
                pixel_values=inputs["pixel_values"],
                image_position_ids=inputs["image_position_ids"],
                mm_token_type_ids=(ids == VOCAB - 1).long(),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )
        return list(out[0, len(prompt) :].tolist())

    check_served(checkpoint, count, reference)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_kimi_k25_image_prompts_decode_as_transformers(kimi: Path, layout: str, count: int) -> None:
    from tandem.models.kimi_image_processor import KimiImageProcessor

    model = Kimi_K25ForConditionalGeneration.from_pretrained(kimi / "transformers", dtype=torch.float32).eval()

    def reference(prompt: list[int], images: list[bytes]) -> list[int]:
        inputs = KimiImageProcessor(**KIMI_PROCESSING)(images=[opened(data) for data in images], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                pixel_values=inputs["pixel_values"],
                image_grid_thw=inputs["image_grid_thw"],
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )
        return list(out[0, len(prompt) :].tolist())

    check_served(kimi / layout, count, reference)
