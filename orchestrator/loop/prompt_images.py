"""A request's images: where they sit in its prompt, checked against how the target's prompts hold an image.

The target announces its layout (TargetInfo.images, tandem.models.image_prompt): an image is written as its
placeholder tokens, whose embeddings the image's features replace, between the family's begin and end tokens; how
many placeholders an image takes is fixed (Gemma 3) or follows its size in pixels (Gemma 4, Kimi-K2.5), read here from
the image's header. A prompt holds at most `limit` images. A request's images (GenerateRequest.images, in order) fill
its prompt's runs of placeholder tokens, the first image the first run(s): one run per image, then one per
pan-and-scan crop it gets (Gemma 3, where its image processor asks). A prompt whose runs are not the images' counts,
or whose number of runs is not what its images fill, is refused naming both. Each image is named by its content's
sha256, which marks its prefix-cache blocks (tandem.layers.block_pool.block_hashes): a block holding an image's tokens
(on the target, on draft replicas and in the prefix routes) is shared only by prompts holding the same image.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.peers.backends import PromptImage
from tandem.models.image_prompt import (
    FixedCount,
    ImagePrompt,
    PanAndScan,
    PatchBudget,
    SoftTokenBudget,
    TokenCount,
)
from tandem.wire import target_pb2


@dataclass(frozen=True)
class ImageLayout:
    limit: int  # images one prompt may hold (the target's --limit-mm-per-prompt)
    prompt: ImagePrompt

    @classmethod
    def announced(cls, info: target_pb2.TargetInfo) -> ImageLayout | None:
        """The layout a target announces; None where it serves no images."""
        if not info.HasField("images") or info.images.limit == 0:
            return None
        images = info.images
        begin = images.begin_token_id if images.HasField("begin_token_id") else None
        end = images.end_token_id if images.HasField("end_token_id") else None
        crops = None
        if images.HasField("pan_and_scan"):
            pas = images.pan_and_scan
            crops = PanAndScan(pas.min_crop_size, pas.max_num_crops, pas.min_ratio_to_activate)
        count = _count(images)
        prompt = ImagePrompt(images.mark_token_id, images.image_token_id, begin, end, images.around, count, crops)
        return cls(images.limit, prompt)


def _count(images: target_pb2.ImageLayout) -> TokenCount:
    kind = images.WhichOneof("count")
    if kind == "soft_token_budget":
        soft = images.soft_token_budget
        return SoftTokenBudget(soft.patch_size, soft.pooling_kernel_size, soft.max_soft_tokens)
    if kind == "patch_budget":
        patches = images.patch_budget
        return PatchBudget(patches.patch_size, patches.merge_size, patches.max_patches, patches.max_side)
    return FixedCount(images.tokens_per_image)


def image_size(data: bytes) -> tuple[int, int]:
    """An image's (height, width) in pixels, from its header; ValueError where the bytes are not an image."""
    from PIL import Image, UnidentifiedImageError  # the orchestrator needs Pillow only when images come

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"{len(data)} bytes that are not an image Pillow reads ({error})") from None
    return height, width


def placeholder_runs(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """The runs [start, end) of placeholder tokens in the prompt, in order."""
    runs: list[tuple[int, int]] = []
    for index, token in enumerate(prompt):
        if token != image_token_id:
            continue
        if runs and runs[-1][1] == index:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))
    return runs


def prompt_images(
    prompt: Sequence[int], images: Sequence[bytes], layout: ImageLayout | None
) -> tuple[PromptImage, ...]:
    """The request's images at their placeholder runs; ValueError ("images: ..." or "prompt: ...") naming what does
    not fit."""
    if layout is None:
        if images:
            raise ValueError(f"images: {len(images)} sent; the target serves no images (--limit-mm-per-prompt)")
        return ()
    if len(images) > layout.limit:
        raise ValueError(f"images: {len(images)} in one prompt, at most {layout.limit} (--limit-mm-per-prompt)")
    image_token = layout.prompt.image_token_id
    if not images and image_token not in prompt:
        return ()  # a text prompt: no scan token by token
    runs = placeholder_runs(prompt, image_token)
    expected = _expected_runs(images, layout.prompt)
    if len(runs) != len(expected):
        crops = f" and {len(expected) - len(images)} pan-and-scan crops" if len(expected) > len(images) else ""
        raise ValueError(f"images: {len(images)} sent{crops} for a prompt holding {len(runs)} image placeholder runs")
    placed = []
    for (start, end), (index, crop, tokens) in zip(runs, expected, strict=True):
        if end - start != tokens:
            raise ValueError(
                f"prompt: a run of {end - start} image placeholder tokens (id {image_token}) at token {start}; "
                f"images[{index}] takes {tokens}"
            )
        data = images[index]
        placed.append(PromptImage(start, end, bytes(data), hashlib.sha256(data).hexdigest(), crop))
    return tuple(placed)


def _expected_runs(images: Sequence[bytes], prompt: ImagePrompt) -> list[tuple[int, int, int]]:
    """(image index, crop, placeholders) of each run the images fill, in order: an image, then its crops."""
    expected = []
    for index, data in enumerate(images):
        try:
            size = image_size(data)
            tokens, crops = prompt.tokens(*size), prompt.crops(*size)
        except ValueError as error:
            raise ValueError(f"images[{index}]: {error}") from None
        expected += [(index, crop, tokens) for crop in range(1 + crops)]
    return expected
