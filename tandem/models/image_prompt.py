"""How a checkpoint's processor writes an image into a prompt, and how many tokens an image of a given size takes.

The chat template writes one mark per image (`mark_token_id`); the processor replaces each mark with the image's
tokens: `around` text, the begin token, as many placeholder tokens (`image_token_id`) as the image takes, the end
token, `around` again. The model puts the image's features in place of the placeholders' embeddings. Per family:

| family     | the template's mark | an image's tokens                               | placeholders per image         |
|------------|---------------------|-------------------------------------------------|--------------------------------|
| Gemma 3    | begin-of-image      | "\\n\\n", begin, placeholders, end, "\\n\\n"    | mm_tokens_per_image (fixed)    |
| Gemma 4    | the image token     | begin, placeholders, end                         | by size (`SoftTokenBudget`)    |
| Kimi-K2.5  | <|media_pad|>       | placeholders (the template wrote begin and end) | by size (`PatchBudget`)        |

Both sides of the wire use it: the target announces it (TargetInfo.images), the orchestrator expands a chat's marks
and checks a prompt's runs of placeholders with it, so this module imports neither torch nor a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FixedCount:
    """Every image takes the same number of placeholders (Gemma 3's pooled grid)."""

    tokens_per_image: int

    def tokens(self, height: int, width: int) -> int:
        return self.tokens_per_image


@dataclass(frozen=True)
class SoftTokenBudget:
    """Gemma 4's image processor: each image resized, keeping its aspect ratio, to the largest size whose sides are
    multiples of `pooling_kernel_size * patch_size` pixels and whose area is at most `max_soft_tokens *
    pooling_kernel_size ** 2` patches; one soft token per `pooling_kernel_size` square of patches. Example (patch 16,
    kernel 3, 280 tokens: 2520 patches, sides in multiples of 48 pixels): a 640 x 480 (width x height) photo is scaled
    by sqrt(2520 * 256 / 307200) = 1.449 to 927.4 x 695.6, rounded down to 912 x 672, 57 x 42 patches, 19 x 14 = 266
    tokens. An image too thin for one 48-pixel row gets one row and as many columns as its aspect ratio, at most
    `max_soft_tokens` squares."""

    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int

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

    def tokens(self, height: int, width: int) -> int:
        """The soft tokens (placeholders) of an image of (height, width) pixels."""
        new_height, new_width = self.resized(height, width)
        patches = (new_height // self.patch_size) * (new_width // self.patch_size)
        return patches // self.pooling_kernel_size**2


@dataclass(frozen=True)
class PatchBudget:
    """How big an image's patch grid gets: transformers' `navit_resize` rule for Kimi-K2.5."""

    patch_size: int
    merge_size: int  # patches a side of one merge window (one placeholder token)
    max_patches: int
    max_side: int  # patches a side at most (the processor's size["max_height"])

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """An image's (height, width) in pixels -> its resized (height, width), then padded (height, width)."""
        patch = self.patch_size
        patches = max(1.0, height // patch) * max(1.0, width // patch)
        side = self.max_side * patch  # pixels
        scale = min(1.0, math.sqrt(self.max_patches / patches), side / height, side / width)
        resized = (min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side))
        window = self.merge_size * patch
        return resized, (-(-resized[0] // window) * window, -(-resized[1] // window) * window)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """An image's size in pixels -> its (rows, columns) of patches after resize and pad."""
        _, (padded_height, padded_width) = self.sizes(height, width)
        return padded_height // self.patch_size, padded_width // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """The placeholder tokens of an image of this size: its merge windows."""
        rows, columns = self.grid(height, width)
        return rows * columns // self.merge_size**2


TokenCount = FixedCount | SoftTokenBudget | PatchBudget


@dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan-and-scan: an image whose aspect ratio reaches `min_ratio_to_activate` is also cut along its long
    side into crops (their number near the ratio, rounded half up, 2 to `max_num_crops`, none narrower than
    `min_crop_size` pixels), each encoded as an image of its own after the original. Example (256, 4, 1.2): a 600 x
    200 (width x height) image gives 3 crops of 200 x 200; a 300 x 200 one none (a 150-pixel crop is too small)."""

    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float

    def crops(self, height: int, width: int) -> int:
        """How many crops an image of (height, width) pixels gets; 0: none."""
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return 0
        count = min(math.floor(long / short + 0.5), math.floor(long / self.min_crop_size))
        count = min(self.max_num_crops, max(2, count))
        crop = math.ceil(long / count)
        return 0 if min(crop, short) < self.min_crop_size else count


# The processor's words around an image's crops (Gemma3Processor), then the crops separated by one space.
CROPS_BEFORE, CROPS_BETWEEN = "Here is the original image ", " and here are some crops to help you see better "


@dataclass(frozen=True)
class ImagePrompt:
    mark_token_id: int  # what the chat template writes for one image
    image_token_id: int  # the placeholder whose embedding an image feature replaces
    begin_token_id: int | None  # written before the placeholders by the processor; None: by the template, or none
    end_token_id: int | None
    around: str  # text the processor writes on both sides of an image's tokens
    count: TokenCount
    pan_and_scan: PanAndScan | None = None  # Gemma 3's crops, where its image processor asks for them

    def tokens(self, height: int, width: int) -> int:
        """The placeholders an image of (height, width) pixels takes."""
        return self.count.tokens(height, width)

    def crops(self, height: int, width: int) -> int:
        """The pan-and-scan crops an image of (height, width) pixels gets besides itself; 0: none."""
        return 0 if self.pan_and_scan is None else self.pan_and_scan.crops(height, width)

    def expansion(self, placeholders: int) -> list[int]:
        """An image's tokens, the `around` text left out: begin, the placeholders, end."""
        begin = [] if self.begin_token_id is None else [self.begin_token_id]
        end = [] if self.end_token_id is None else [self.end_token_id]
        return [*begin, *[self.image_token_id] * placeholders, *end]
