"""Gemma 3's image encoder (tandem.models.gemma3_vision) against transformers' `get_image_features`, on pixel values
made by transformers' own Gemma 3 image processor (its PIL one, which needs no torchvision)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Gemma3ForConditionalGeneration
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from tandem.models.config import ConfigError
from tandem.models.gemma3_vision import VisionConfig, load_gemma3_image_encoder
from tests.helpers.gemma4_checkpoints import write_tiny_gemma3_multimodal

# A 4 x 4 patch grid pooled 2 x 2 into 4 tokens, two encoder layers.
VISION = {"image_size": 56, "patch_size": 14, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-vision"), seed=3, vision=VISION)


def pixel_values(*sizes: tuple[int, int]) -> torch.Tensor:
    """Random RGB images of the given (height, width), through the checkpoint family's image processor."""
    generator = np.random.default_rng(0)
    images = [Image.fromarray(generator.integers(0, 256, (*size, 3), dtype=np.uint8)) for size in sizes]
    processor = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    values: torch.Tensor = processor(images=images, return_tensors="pt")["pixel_values"]
    return values


def reference_features(checkpoint: Path, pixels: torch.Tensor) -> torch.Tensor:
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        features: torch.Tensor = model.model.get_image_features(pixel_values=pixels).pooler_output
    return features


def test_image_features_equal_transformers(checkpoint: Path) -> None:
    pixels = pixel_values((40, 70), (56, 56), (90, 30))
    expected = reference_features(checkpoint, pixels)
    assert expected.shape == (3, 4, 64)
    with torch.no_grad():
        features = load_gemma3_image_encoder(checkpoint)(pixels)
    assert features.shape == expected.shape
    assert (features - expected).abs().max().item() <= 1e-5


def test_the_hub_files_names_load_the_same_encoder(checkpoint: Path, tmp_path: Path) -> None:
    # Google's files keep the tower under vision_tower.vision_model.* (transformers saves vision_tower.*).
    tensors = load_file(str(checkpoint / "model.safetensors"))
    hub = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in tensors.items()}
    save_file(hub, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    pixels = pixel_values((56, 56))
    with torch.no_grad():
        features = load_gemma3_image_encoder(tmp_path)(pixels)
        expected = load_gemma3_image_encoder(checkpoint)(pixels)
    assert torch.equal(features, expected)


def test_a_token_count_that_does_not_pool_the_grid_is_refused(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert VisionConfig.from_hf(config).tokens_per_image == 4
    with pytest.raises(ConfigError, match=r"mm_tokens_per_image: 9 is not a square whose side divides the 4 x 4"):
        VisionConfig.from_hf(config | {"mm_tokens_per_image": 9})
