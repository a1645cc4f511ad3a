"""Images to the features a target's prompt takes at their placeholder tokens: the seam where the image tower runs.

`ImageEncoder` is what the target asks: an image's bytes (PNG, JPEG, WebP: whatever the request carried) -> its
content digest and its features [tokens, text hidden]. `LocalImageEncoder` runs it in the target's process, beside
the text model: the checkpoint's own image processor (transformers' AutoImageProcessor from its
preprocessor_config.json, with the PIL backend on every machine: the same resize and normalization on a CPU without
torchvision and on a GPU machine with it), then the family's image encoder (Gemma 3: tandem.models.gemma3_vision).
Features are kept by digest (sha256 of the bytes) for the last CACHED_IMAGES images, so that an image sent again (a
chat's next turn, the same picture in many agent calls) is not encoded again. Another placement (a service of its own
that the orchestrator calls, as vLLM's and SGLang's encoder disaggregation) would implement the same protocol.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.models.gemma3_vision import Gemma3ImageEncoder, load_gemma3_image_encoder

CACHED_IMAGES = 64  # images whose features a LocalImageEncoder keeps
IMAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)  # checkpoints whose image tower Tandem runs


class ImageError(ValueError):
    """Bytes that are not an image this encoder can read; the message says what is wrong."""


@dataclass(frozen=True)
class ImagePlaceholders:
    """How the checkpoint's processor writes an image into a prompt: begin, tokens_per_image placeholders, end (the
    image's features replace the placeholders' embeddings)."""

    tokens_per_image: int
    begin_token_id: int
    image_token_id: int
    end_token_id: int

    @staticmethod
    def gemma3(hf: dict[str, Any]) -> ImagePlaceholders:
        """A Gemma 3 config.json's ids (transformers' Gemma3Config defaults where it leaves them out)."""
        return ImagePlaceholders(
            hf.get("mm_tokens_per_image", 256),
            hf.get("boi_token_index", 255_999),
            hf.get("image_token_index", 262_144),
            hf.get("eoi_token_index", 256_000),
        )


class ImageEncoder(Protocol):
    @property
    def placeholders(self) -> ImagePlaceholders: ...

    def features(self, data: bytes) -> tuple[str, torch.Tensor]: ...  # -> digest, [tokens, hidden]


class LocalImageEncoder:
    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        from transformers import AutoImageProcessor  # imported by a target that serves images only

        self.processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        self.encoder: Gemma3ImageEncoder = load_gemma3_image_encoder(model_dir, dtype, device)
        self.placeholders = ImagePlaceholders.gemma3(json.loads((model_dir / "config.json").read_text()))
        self.device = device
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def features(self, data: bytes) -> tuple[str, torch.Tensor]:
        digest = hashlib.sha256(data).hexdigest()
        found = self._cache.get(digest)
        if found is None:
            found = self._encoded(data)
            self._cache[digest] = found
            if len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(digest)
        return digest, found

    def _encoded(self, data: bytes) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        except (UnidentifiedImageError, OSError) as error:
            raise ImageError(f"{len(data)} bytes that are not an image Pillow reads ({error})") from None
        with torch.inference_mode():
            features: torch.Tensor = self.encoder(pixels.to(self.device))[0]
        return features


def image_encoder_for(model_dir: Path, dtype: torch.dtype, device: str) -> LocalImageEncoder | None:
    """The image encoder of a checkpoint whose tower Tandem runs (IMAGE_ARCHITECTURES), else None."""
    config = json.loads((model_dir / "config.json").read_text())
    if not set(config.get("architectures") or ()) & set(IMAGE_ARCHITECTURES) or "vision_config" not in config:
        return None
    return LocalImageEncoder(model_dir, dtype, device)
