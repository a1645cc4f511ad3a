"""Kimi-K2.5's image encoder (tandem.models.kimi_vision) and preprocessing (tandem.models.kimi_image_processor)
against transformers: features against `get_image_features` on a tiny random checkpoint in both namings, pixels and
placeholder counts against transformers' own Kimi-K2.5 processor classes (run over a stand-in for torchvision's
three calls, tests.helpers.torchvision_stand_in)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import Kimi_K25ForConditionalGeneration, PreTrainedTokenizerFast
from transformers.image_processing_utils import BatchFeature

from tandem.models.config import ConfigError
from tandem.models.image_encoder import image_encoder_for
from tandem.models.kimi_image_processor import KimiImageProcessor, kimi_image_prompt
from tandem.models.kimi_vision import KimiVisionConfig, load_kimi_image_encoder
from tests.helpers.deepseek_checkpoints import TinyDeepseekSpec
from tests.helpers.images import opened, png
from tests.helpers.kimi_checkpoints import KIMI_PROCESSING, to_hub_layout, write_tiny_kimi_k25
from tests.helpers.torchvision_stand_in import transformers_kimi_image_processing, transformers_kimi_processor

# The tiny tower's patches are 4 pixels and its position table 4 x 4; at most 8 patches a side and 48 in all.
# (height, width) in pixels -> patch grid: 6 x 8 (scaled down to 26 x 46 pixels, padded to 6 x 8 patches: the
# position table resampled), 4 x 4 (the table as it is), 8 x 4 (padded on the right).
SIZES = ((40, 70), (16, 16), (30, 12))
TOKENS = (12, 4, 8)
MARKERS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kimi-vision")
    written = write_tiny_kimi_k25(root / "transformers", TinyDeepseekSpec(num_layers=1))
    hub = to_hub_layout(Path(shutil.copytree(written, root / "hub")))
    return {"transformers": written, "hub": hub}


@pytest.fixture(scope="module")
def inputs() -> BatchFeature:
    images = [opened(png(height, width, seed=index)) for index, (height, width) in enumerate(SIZES)]
    return KimiImageProcessor(**KIMI_PROCESSING)(images=images, return_tensors="pt")


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path], inputs: BatchFeature) -> tuple[torch.Tensor, ...]:
    model = Kimi_K25ForConditionalGeneration.from_pretrained(checkpoints["transformers"], dtype=torch.float32).eval()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return tuple(features.pooler_output)


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_image_features_equal_transformers(
    layout: str, checkpoints: dict[str, Path], inputs: BatchFeature, expected: tuple[torch.Tensor, ...]
) -> None:
    with safe_open(str(checkpoints[layout] / "model.safetensors"), framework="pt") as tensors:
        names = set(tensors.keys())
    saved = {
        "transformers": "vision_tower.encoder.patch_embed.proj.weight",
        "hub": "vision_tower.patch_embed.proj.weight",
    }
    assert saved[layout] in names
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8], [1, 4, 4], [1, 8, 4]]
    with torch.no_grad():
        features = load_kimi_image_encoder(checkpoints[layout])(inputs["pixel_values"], inputs["image_grid_thw"])
    assert tuple(len(image) for image in expected) == TOKENS
    for image, reference, tokens in zip(features.split(TOKENS), expected, TOKENS, strict=True):
        assert image.shape == reference.shape == (tokens, 64)
        assert (image - reference).abs().max().item() <= 1e-5


def test_the_targets_encoder_gives_the_same_features_from_the_bytes(
    checkpoints: dict[str, Path], expected: tuple[torch.Tensor, ...]
) -> None:
    hub = checkpoints["hub"]
    KimiImageProcessor(**KIMI_PROCESSING).save_pretrained(hub)  # the processor's settings in preprocessor_config.json
    encoder = image_encoder_for(hub, torch.float32, "cpu")
    assert encoder is not None
    for seed, (size, reference, tokens) in enumerate(zip(SIZES, expected, TOKENS, strict=True)):
        assert encoder.prompt.tokens(*size) == tokens
        assert (encoder.features(png(*size, seed=seed))[1] - reference).abs().max().item() <= 1e-5


def test_pixels_equal_transformers_processor() -> None:
    # RGB of three sizes, RGBA (composited on white) and grey, through the same PNG bytes.
    images = [opened(png(height, width, seed=index)) for index, (height, width) in enumerate(SIZES)]
    images += [opened(png(21, 33, "RGBA")), opened(png(50, 9, "L"))]
    with transformers_kimi_image_processing() as module:
        reference = module.Kimi_K25ImageProcessor(**KIMI_PROCESSING)(images=images, return_tensors="pt")
    ours = KimiImageProcessor(**KIMI_PROCESSING)(images=images, return_tensors="pt")
    assert ours["image_grid_thw"].tolist() == reference["image_grid_thw"].tolist()
    assert torch.equal(ours["pixel_values"], reference["pixel_values"])


def test_placeholder_counts_equal_transformers_processor(checkpoints: dict[str, Path]) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoints["transformers"])
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    sizes = [(height, width) for height in (1, 13, 40, 333, 1080, 5000) for width in (1, 30, 70, 777, 1920, 4000)]
    with transformers_kimi_image_processing() as module:
        for settings in (KIMI_PROCESSING, {}):  # the tiny tower's, and Kimi-K2.5's defaults (14-pixel patches, 16384)
            processor = transformers_kimi_processor(module.Kimi_K25ImageProcessor(**settings), tokenizer)
            counts = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
            budget = KimiImageProcessor(**settings).budget
            assert [budget.tokens(height, width) for height, width in sizes] == counts
        # transformers' expansion of the chat template's image marker, with Kimi-K2.5's defaults (the loop's last)
        image_marker = f"{MARKERS[0]}image{MARKERS[1]}{MARKERS[2]}{MARKERS[3]}"
        prompt = processor(text=[f"look {image_marker} here"], images=[opened(png(40, 70))])["input_ids"][0]
    begin, content, pad, end = tokenizer.convert_tokens_to_ids(list(MARKERS))
    start = prompt.index(begin)
    written = [begin, *tokenizer.encode("image", add_special_tokens=False), content]
    tokens = budget.tokens(40, 70)
    assert prompt[start : start + len(written) + tokens + 1] == [*written, *[pad] * tokens, end]
    config = json.loads((checkpoints["transformers"] / "config.json").read_text())
    ids = kimi_image_prompt(config, budget)
    assert (ids.mark_token_id, ids.image_token_id, ids.begin_token_id, ids.end_token_id) == (315, 315, None, None)
    assert ids.expansion(3) == [315] * 3 and ids.count == budget


def test_a_projection_size_other_than_the_towers_is_refused(checkpoints: dict[str, Path]) -> None:
    config = json.loads((checkpoints["hub"] / "config.json").read_text())
    assert KimiVisionConfig.from_hf(config).hidden_size == 32
    with pytest.raises(ConfigError, match=r"projection_hidden_size: 48 is not the vision tower's hidden_size 32"):
        KimiVisionConfig.from_hf(config | {"projection_hidden_size": 48})


def test_a_video_grid_is_refused(checkpoints: dict[str, Path], inputs: BatchFeature) -> None:
    encoder = load_kimi_image_encoder(checkpoints["hub"])
    frames = torch.tensor([[2, 4, 4]])
    with pytest.raises(ValueError, match=r"image grid \(t 2, h 4, w 4\): not one frame of whole 2 x 2 merge windows"):
        encoder(inputs["pixel_values"][:32], frames)
