"""Gemma 4's image tokens as its processor writes them: the soft-token budget of a checkpoint, and the ids.

The image processor's budget (`SoftTokenBudget`, tandem.models.image_prompt) comes from the checkpoint's
preprocessor_config.json. The chat template writes one image token per image; Gemma 4's processor replaces each with
the begin-of-image token, as many image tokens as the image's soft tokens, and the end-of-image token (its
`replace_image_token`). The model puts the image's features in place of the image tokens' embeddings. Checked against
transformers' image processor and processor (tests/unit/test_gemma4_vision.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.models.config import ConfigError
from tandem.models.image_prompt import ImagePrompt, SoftTokenBudget

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the max_soft_tokens Gemma 4's image processor accepts


def read_budget(model_dir: Path) -> SoftTokenBudget:
    """The image processor's settings in a checkpoint: preprocessor_config.json, else processor_config.json's
    image_processor (transformers' Gemma4ImageProcessor defaults where a field is left out)."""
    settings: dict[str, Any] = {}
    single, combined = model_dir / "preprocessor_config.json", model_dir / "processor_config.json"
    if single.is_file():
        settings = json.loads(single.read_text())
    elif combined.is_file():
        settings = json.loads(combined.read_text()).get("image_processor") or {}
    budget = SoftTokenBudget(
        patch_size=settings.get("patch_size", 16),
        pooling_kernel_size=settings.get("pooling_kernel_size", 3),
        max_soft_tokens=settings.get("max_soft_tokens", 280),
    )
    if budget.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ConfigError(f"max_soft_tokens: {budget.max_soft_tokens} is not one of {SOFT_TOKEN_BUDGETS}")
    return budget


def gemma4_image_prompt(hf: dict[str, Any], budget: SoftTokenBudget) -> ImagePrompt:
    """A Gemma 4 config.json's ids (transformers' Gemma4Config defaults where it leaves them out): the template's
    image token is the mark and each placeholder, written between begin and end."""
    image = hf.get("image_token_id", 258_880)
    return ImagePrompt(image, image, hf.get("boi_token_id", 255_999), hf.get("eoi_token_id", 258_882), "", budget)
