"""How many soft tokens Gemma 4's image processor gives an image, and how its processor writes them into a prompt.

The image processor resizes every image, keeping its aspect ratio, to the largest size whose sides are multiples of
`pooling_kernel_size * patch_size` pixels and whose area is at most `max_soft_tokens * pooling_kernel_size ** 2`
patches; the image gets one soft token per `pooling_kernel_size` square of patches. Example (patch 16, kernel 3, 280
tokens: 2520 patches, sides in multiples of 48 pixels): a 640 x 480 (width x height) photo is scaled by
sqrt(2520 * 256 / 307200) = 1.449 to 927.4 x 695.6, rounded down to 912 x 672, 57 x 42 patches, 19 x 14 = 266 tokens.
An image too thin for one 48-pixel row gets one row and as many columns as its aspect ratio, at most
`max_soft_tokens` squares.

The chat template writes one image token per image; Gemma 4's processor replaces each with the begin-of-image token,
as many image tokens as the image's soft tokens, and the end-of-image token (its `replace_image_token`). The model
puts the image's features in place of the image tokens' embeddings. Checked against transformers' image processor and
processor (tests/unit/test_gemma4_vision.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.models.config import ConfigError

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # the max_soft_tokens Gemma 4's image processor accepts


@dataclass(frozen=True)
class ImageBudget:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int

    @staticmethod
    def read(model_dir: Path) -> ImageBudget:
        """The image processor's settings in a checkpoint: preprocessor_config.json, else processor_config.json's
        image_processor (transformers' Gemma4ImageProcessor defaults where a field is left out)."""
        settings: dict[str, Any] = {}
        single, combined = model_dir / "preprocessor_config.json", model_dir / "processor_config.json"
        if single.is_file():
            settings = json.loads(single.read_text())
        elif combined.is_file():
            settings = json.loads(combined.read_text()).get("image_processor") or {}
        budget = ImageBudget(
            patch_size=settings.get("patch_size", 16),
            pooling_kernel_size=settings.get("pooling_kernel_size", 3),
            max_soft_tokens=settings.get("max_soft_tokens", 280),
        )
        if budget.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ConfigError(f"max_soft_tokens: {budget.max_soft_tokens} is not one of {SOFT_TOKEN_BUDGETS}")
        return budget

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) in pixels the image processor resizes an image of (height, width) to."""
        side = self.pooling_kernel_size * self.patch_size  # both sides are multiples of it
        most_pixels = self.max_soft_tokens * self.pooling_kernel_size**2 * self.patch_size**2
        scale = math.sqrt(most_pixels / (height * width))
        # The same floating-point operations as transformers', so that a side on a boundary rounds the same way.
        new_height = math.floor(scale * height / side) * side
        new_width = math.floor(scale * width / side) * side
        if new_height == 0 and new_width == 0:
            raise ValueError(f"a {width} x {height} image resizes to nothing within {self.max_soft_tokens} soft tokens")
        longest = self.max_soft_tokens * side
        if new_height == 0:
            new_height, new_width = side, min(math.floor(width / height) * side, longest)
        elif new_width == 0:
            new_height, new_width = min(math.floor(height / width) * side, longest), side
        if new_height * new_width > most_pixels:
            raise ValueError(
                f"a {width} x {height} image resizes to {new_width} x {new_height}: over "
                f"{self.max_soft_tokens} soft tokens"
            )
        return new_height, new_width

    def soft_tokens(self, height: int, width: int) -> int:
        """The soft tokens (image placeholders) of an image of (height, width) pixels."""
        new_height, new_width = self.resized(height, width)
        patches = (new_height // self.patch_size) * (new_width // self.patch_size)
        return patches // self.pooling_kernel_size**2


@dataclass(frozen=True)
class Gemma4ImageTokens:
    """The token ids Gemma 4's processor writes around and for an image's soft tokens."""

    begin_token_id: int
    image_token_id: int  # the chat template's one per image, and each placeholder of the expansion
    end_token_id: int

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> Gemma4ImageTokens:
        """A Gemma 4 config.json's ids (transformers' Gemma4Config defaults where it leaves them out)."""
        return Gemma4ImageTokens(
            hf.get("boi_token_id", 255_999), hf.get("image_token_id", 258_880), hf.get("eoi_token_id", 258_882)
        )

    def expansion(self, soft_tokens: int) -> list[int]:
        """What one image token of the templated prompt becomes: begin, `soft_tokens` image tokens, end."""
        return [self.begin_token_id, *[self.image_token_id] * soft_tokens, self.end_token_id]
