"""The target's image encoder (tandem.models.image_encoder): an image's bytes through the checkpoint's own image
processor (PIL backend) and Gemma 3's encoder give transformers' features; features are kept by content digest;
bytes that are not an image are refused naming them."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

from tandem.models.image_encoder import ImageError, image_encoder_for
from tandem.models.image_prompt import FixedCount
from tests.helpers.gemma4_checkpoints import write_tiny_gemma3_multimodal

VISION = {"image_size": 56, "patch_size": 14, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-encoder"), seed=2, vision=VISION)


def encoded(image: Image.Image, kind: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=kind)
    return out.getvalue()


@pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP"])
def test_an_images_bytes_give_transformers_features(checkpoint: Path, kind: str) -> None:
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 80, 3), dtype=np.uint8))
    data = encoded(picture, kind)
    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    with Image.open(io.BytesIO(data)) as decoded:
        pixels = processor(images=[decoded], return_tensors="pt")["pixel_values"]
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels).pooler_output[0]
    encoder = image_encoder_for(checkpoint, torch.float32, "cpu")
    assert encoder is not None and encoder.prompt.count == FixedCount(4)
    digest, features = encoder.features(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert features.shape == (4, 64) and (features - expected).abs().max().item() <= 1e-5
    assert encoder.features(data)[1] is features  # kept: not encoded again


def test_bytes_that_are_not_an_image_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ImageError, match="11 bytes that are not an image Pillow reads"):
        encoder = image_encoder_for(checkpoint, torch.float32, "cpu")
        assert encoder is not None
        encoder.features(b"hello world")
