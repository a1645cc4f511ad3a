"""A request's images: where they sit in its prompt, checked against how the target's prompts hold an image.

The target announces its layout (TargetInfo.images): an image is `begin`, then `tokens_per_image` placeholder tokens
whose embeddings the image's features replace, then `end`, and a prompt holds at most `limit` images. A request's
images (GenerateRequest.images, in order) fill its prompt's runs of placeholder tokens, the first image the first run:
a prompt whose runs are not whole, or whose number of runs is not its number of images, is refused naming both.
Each image is named by its content's sha256, which joins the request's cache salt: a prefix-cache block holding an
image's tokens (on the target and on draft replicas) is shared only by prompts holding the same image.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.peers.backends import PromptImage
from tandem.wire import target_pb2


@dataclass(frozen=True)
class ImageLayout:
    limit: int  # images one prompt may hold (the target's --limit-mm-per-prompt)
    tokens_per_image: int
    begin_token_id: int
    image_token_id: int  # the placeholder
    end_token_id: int

    @classmethod
    def announced(cls, info: target_pb2.TargetInfo) -> ImageLayout | None:
        """The layout a target announces; None where it serves no images."""
        if not info.HasField("images") or info.images.limit == 0:
            return None
        images = info.images
        return cls(
            images.limit, images.tokens_per_image, images.begin_token_id, images.image_token_id, images.end_token_id
        )


def placeholder_starts(prompt: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
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
    """The request's images at their placeholder runs; ValueError ("images: ...") naming what does not fit."""
    if layout is None:
        if images:
            raise ValueError(f"images: {len(images)} sent; the target serves no images (--limit-mm-per-prompt)")
        return ()
    if len(images) > layout.limit:
        raise ValueError(f"images: {len(images)} in one prompt, at most {layout.limit} (--limit-mm-per-prompt)")
    runs = placeholder_starts(prompt, layout.image_token_id)
    for start, end in runs:
        if end - start != layout.tokens_per_image:
            raise ValueError(
                f"prompt: a run of {end - start} image placeholder tokens (id {layout.image_token_id}) at token "
                f"{start}; an image takes {layout.tokens_per_image}"
            )
    if len(runs) != len(images):
        raise ValueError(f"images: {len(images)} sent for a prompt holding {len(runs)} image placeholders")
    return tuple(
        PromptImage(start, end, bytes(data), hashlib.sha256(data).hexdigest())
        for (start, end), data in zip(runs, images, strict=True)
    )
