"""Images to the features a target's prompt takes at their placeholder tokens: the seam where the image tower runs.

`ImageEncoder` is what the target asks: an image's bytes (PNG, JPEG, WebP: whatever the request carried) -> its
content digest and its features [tokens, text hidden]. `LocalImageEncoder` runs it in the target's process, beside
the text model: the checkpoint's own image processor, then the family's image encoder (IMAGE_TOWERS). The processor
is read from the checkpoint's preprocessor_config.json and runs the same on every machine: transformers' PIL backend
for Gemma 3 and Gemma 4, which needs no torchvision (whose registry wheels are CUDA builds that do not load beside
the CPU torch), and for Kimi-K2.5, whose processor transformers ships on torchvision only, torchvision's CPU steps
over plain torch (tandem.models.kimi_image_processor).
Features are kept by digest (sha256 of the bytes) for the last CACHED_IMAGES images, so that an image sent again (a
chat's next turn, the same picture in many agent calls) is not encoded again. Another placement (a service of its own
that the orchestrator calls, as vLLM's and SGLang's encoder disaggregation) would implement the same protocol.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.models.config import ConfigError
from tandem.models.image_prompt import FixedCount, ImagePrompt

CACHED_IMAGES = 64  # images whose features a LocalImageEncoder keeps


class ImageError(ValueError):
    """Bytes that are not an image this encoder can read; the message says what is wrong."""


class ImageEncoder(Protocol):
    @property
    def prompt(self) -> ImagePrompt: ...  # how the checkpoint's processor writes an image into a prompt

    def features(self, data: bytes) -> tuple[str, torch.Tensor]: ...  # -> digest, [tokens, hidden]


Encode = Callable[[Any], torch.Tensor]  # a PIL image -> its features [tokens, hidden]


def gemma3_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Gemma 3: the template's begin-of-image mark becomes a blank line, begin, mm_tokens_per_image placeholders,
    end and a blank line (Gemma3Processor); transformers' PIL image processor, then the SigLIP tower."""
    from transformers import AutoImageProcessor  # imported by a target that serves images only

    from tandem.models.gemma3_vision import load_gemma3_image_encoder

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    if getattr(processor, "do_pan_and_scan", False):
        raise ConfigError(
            "preprocessor_config.json: do_pan_and_scan is true; Tandem serves each image whole, without pan-and-scan "
            "crops (set it to false)"
        )
    encoder = load_gemma3_image_encoder(model_dir, dtype, device)
    begin = hf.get("boi_token_index", 255_999)
    count = FixedCount(hf.get("mm_tokens_per_image", 256))
    prompt = ImagePrompt(
        begin, hf.get("image_token_index", 262_144), begin, hf.get("eoi_token_index", 256_000), "\n\n", count
    )

    def encode(image: Any) -> torch.Tensor:
        return encoder(processor(images=[image], return_tensors="pt")["pixel_values"].to(device))[0]

    return prompt, encode


def gemma4_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Gemma 4: transformers' PIL image processor (resized to the soft-token budget), then the 2-D rope tower."""
    from transformers import AutoImageProcessor

    from tandem.models.gemma4_image_tokens import gemma4_image_prompt, read_budget
    from tandem.models.gemma4_vision import load_gemma4_image_encoder

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    encoder = load_gemma4_image_encoder(model_dir, dtype, device)

    def encode(image: Any) -> torch.Tensor:
        inputs = processor(images=[image], return_tensors="pt")
        return encoder(inputs["pixel_values"].to(device), inputs["image_position_ids"].to(device))[0]

    return gemma4_image_prompt(hf, read_budget(model_dir)), encode


def kimi_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Kimi-K2.5: its image processor in plain torch (tandem.models.kimi_image_processor), then MoonViT."""
    from tandem.models.kimi_image_processor import KimiImageProcessor, kimi_image_prompt
    from tandem.models.kimi_vision import load_kimi_image_encoder

    processor = KimiImageProcessor.from_pretrained(model_dir)
    encoder = load_kimi_image_encoder(model_dir, dtype, device)

    def encode(image: Any) -> torch.Tensor:
        inputs = processor(images=[image], return_tensors="pt")
        return encoder(inputs["pixel_values"].to(device), inputs["image_grid_thw"])

    return kimi_image_prompt(hf, processor.budget), encode


Tower = Callable[[Path, dict[str, Any], torch.dtype, str], tuple[ImagePrompt, Encode]]
# The checkpoints whose image tower Tandem runs, by architecture.
IMAGE_TOWERS: dict[str, Tower] = {
    "Gemma3ForConditionalGeneration": gemma3_tower,
    "Gemma4ForConditionalGeneration": gemma4_tower,
    "KimiK25ForConditionalGeneration": kimi_tower,
    "Kimi_K25ForConditionalGeneration": kimi_tower,
}


class LocalImageEncoder:
    def __init__(self, prompt: ImagePrompt, encode: Encode, device: str = "cpu") -> None:
        self.prompt = prompt
        self.encode = encode
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
                with torch.inference_mode():
                    return self.encode(image)
        except (UnidentifiedImageError, OSError) as error:
            raise ImageError(f"{len(data)} bytes that are not an image Pillow reads ({error})") from None


def image_encoder_for(model_dir: Path, dtype: torch.dtype, device: str) -> LocalImageEncoder | None:
    """The image encoder of a checkpoint whose tower Tandem runs (IMAGE_TOWERS), else None."""
    hf = json.loads((model_dir / "config.json").read_text())
    towers = [IMAGE_TOWERS[name] for name in hf.get("architectures") or () if name in IMAGE_TOWERS]
    if not towers or "vision_config" not in hf:
        return None
    return LocalImageEncoder(*towers[0](model_dir, hf, dtype, device), device)
