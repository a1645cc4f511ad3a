"""Gemma 4's image encoder (tandem.models.gemma4_vision) against transformers' `get_image_features`, on PNG bytes
through transformers' own Gemma 4 image processor (its PIL one, which needs no torchvision), and the soft-token counts
and prompt expansion (tandem.models.gemma4_image_tokens) against that processor and Gemma4Processor's."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoImageProcessor, Gemma4ForConditionalGeneration
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor, get_aspect_ratio_preserving_size

from tandem.models.config import ConfigError
from tandem.models.gemma4_image_tokens import SOFT_TOKEN_BUDGETS, gemma4_image_prompt, read_budget
from tandem.models.gemma4_vision import VisionConfig, load_gemma4_image_encoder
from tandem.models.image_encoder import image_encoder_for
from tandem.models.image_prompt import SoftTokenBudget
from tests.helpers.gemma4_checkpoints import GEMMA4_SOFT_TOKENS, SPECS, write_tiny_gemma4_multimodal

# (height, width): wide, tall, and one too thin for a row of pooled patches at full scale (one row, 70 tokens).
SIZES = ((40, 70), (90, 30), (10, 1000))
VISIONS = {
    "plain": {},
    # Two layers, one KV head for two query heads, clamped linears and standardized soft tokens.
    "clamped": {"num_hidden_layers": 2, "num_key_value_heads": 1, "use_clipped_linears": True, "standardize": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_tiny_gemma4_multimodal(tmp_path_factory.mktemp(f"gemma4-{name}"), SPECS["dense"], vision=vision)
        for name, vision in VISIONS.items()
    }


def png(size: tuple[int, int], seed: int) -> bytes:
    """A random RGB image of (height, width), as PNG bytes."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    written = io.BytesIO()
    Image.fromarray(pixels).save(written, format="PNG")
    return written.getvalue()


def processed(checkpoint: Path, sizes: tuple[tuple[int, int], ...]) -> dict[str, torch.Tensor]:
    """Images of the given sizes through the checkpoint's own image processor."""
    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    images = [Image.open(io.BytesIO(png(size, seed))) for seed, size in enumerate(sizes)]
    return dict(processor(images=images, return_tensors="pt"))


@pytest.mark.parametrize("vision", sorted(VISIONS))
def test_image_features_equal_transformers(checkpoints: dict[str, Path], vision: str) -> None:
    checkpoint = checkpoints[vision]
    inputs = processed(checkpoint, SIZES)
    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
        features = load_gemma4_image_encoder(checkpoint)(inputs["pixel_values"], inputs["image_position_ids"])
    assert [len(image) for image in expected] == inputs["num_soft_tokens_per_image"].tolist() == [66, 56, 70]
    for ours, theirs in zip(features, expected, strict=True):
        assert ours.shape == theirs.shape == (theirs.shape[0], 64)
        assert (ours - theirs).abs().max().item() <= 1e-5
    # The target's encoder, from the image's bytes: the same features, and the prompt's count for its size.
    encoder = image_encoder_for(checkpoint, torch.float32, "cpu")
    assert encoder is not None
    for seed, (size, theirs) in enumerate(zip(SIZES, expected, strict=True)):
        assert encoder.prompt.tokens(*size) == len(theirs)
        assert (encoder.features(png(size, seed))[1] - theirs).abs().max().item() <= 1e-5


def test_the_clamps_and_the_standardization_change_the_features(checkpoints: dict[str, Path]) -> None:
    # Else the "clamped" parity above would hold with either left out.
    checkpoint = checkpoints["clamped"]
    inputs = processed(checkpoint, SIZES[:1])
    encoder = load_gemma4_image_encoder(checkpoint)
    with torch.no_grad():
        features = encoder(inputs["pixel_values"], inputs["image_position_ids"])[0]
        for name, buffer in encoder.named_buffers():
            if name.endswith(("input_min", "output_min", "input_max", "output_max")):
                buffer.fill_(float("-inf") if name.endswith("min") else float("inf"))
        unclamped = encoder(inputs["pixel_values"], inputs["image_position_ids"])[0]
        encoder.vision_tower.std_bias.zero_()
        encoder.vision_tower.std_scale.fill_(1.0)
        plain = encoder(inputs["pixel_values"], inputs["image_position_ids"])[0]
    assert (features - unclamped).abs().max().item() > 1e-2
    assert (unclamped - plain).abs().max().item() > 1e-2


def test_the_base_model_names_load_the_same_encoder(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # transformers saves Gemma4ForConditionalGeneration under model.*, Gemma4Model without the prefix.
    checkpoint, base = checkpoints["clamped"], tmp_path
    tensors = load_file(str(checkpoint / "model.safetensors"))
    save_file(
        {name.removeprefix("model."): tensor for name, tensor in tensors.items()}, str(base / "model.safetensors")
    )
    (base / "config.json").write_text((checkpoint / "config.json").read_text())
    inputs = processed(checkpoint, SIZES[:1])
    with torch.no_grad():
        features = load_gemma4_image_encoder(base)(inputs["pixel_values"], inputs["image_position_ids"])
        expected = load_gemma4_image_encoder(checkpoint)(inputs["pixel_values"], inputs["image_position_ids"])
    assert torch.equal(features[0], expected[0])


def test_soft_tokens_equal_the_image_processors(checkpoints: dict[str, Path]) -> None:
    checkpoint = checkpoints["plain"]
    processor = AutoImageProcessor.from_pretrained(checkpoint, backend="pil")
    budget = read_budget(checkpoint)
    assert budget == SoftTokenBudget(processor.patch_size, processor.pooling_kernel_size, processor.max_soft_tokens)
    assert budget.max_soft_tokens == GEMMA4_SOFT_TOKENS
    sizes = (*SIZES, (1000, 10), (48, 48), (1, 1), (768, 1024))
    counts = processed(checkpoint, sizes)["num_soft_tokens_per_image"].tolist()
    assert [budget.tokens(height, width) for height, width in sizes] == counts
    # Every budget, on sizes drawn at random: the resized sides equal transformers' processor's.
    generator = np.random.default_rng(5)
    for max_soft_tokens in SOFT_TOKEN_BUDGETS:
        other = SoftTokenBudget(16, 3, max_soft_tokens)
        for height, width in generator.integers(1, 4000, (40, 2)).tolist():
            expected = get_aspect_ratio_preserving_size(height, width, 16, max_soft_tokens * 9, 3)
            assert other.resized(height, width) == expected


def test_an_image_token_expands_as_the_processor_writes_it() -> None:
    budget = SoftTokenBudget(16, 3, 280)
    tokens = gemma4_image_prompt({}, budget)
    assert (tokens.begin_token_id, tokens.image_token_id, tokens.end_token_id) == (255_999, 258_880, 258_882)
    assert tokens.mark_token_id == tokens.image_token_id and tokens.around == ""  # Gemma4Config's defaults
    small = gemma4_image_prompt({"boi_token_id": 7, "image_token_id": 8, "eoi_token_id": 9}, budget)
    assert small.expansion(2) == [7, 8, 8, 9]
    # Gemma4Processor's own replacement (it cannot be built here: its video processor needs torchvision), with token
    # strings that, as Gemma 4's, share a prefix.
    names = SimpleNamespace(boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>")
    written = Gemma4Processor.replace_image_token(names, {"num_soft_tokens_per_image": [3, 66]}, 1)
    ids = {names.boi_token: tokens.begin_token_id, names.image_token: tokens.image_token_id}
    ids[names.eoi_token] = tokens.end_token_id
    pieces = re.findall("|".join(map(re.escape, sorted(ids, key=len, reverse=True))), written)
    assert "".join(pieces) == written
    assert [ids[piece] for piece in pieces] == tokens.expansion(66)


def test_bad_configs_are_refused_naming_the_field(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    config = json.loads((checkpoints["plain"] / "config.json").read_text())
    assert VisionConfig.from_hf(config).head_dim == 8
    bad_head = config | {"vision_config": config["vision_config"] | {"head_dim": 6}}
    with pytest.raises(ConfigError, match=r"vision_config.head_dim: 6 is not a multiple of 4"):
        VisionConfig.from_hf(bad_head)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 100}))
    with pytest.raises(ConfigError, match=r"max_soft_tokens: 100 is not one of \(70, 140, 280, 560, 1120\)"):
        read_budget(tmp_path)
