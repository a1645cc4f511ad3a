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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from tandem.models.image_prompt import FixedCount, ImagePrompt, PanAndScan

CACHED_IMAGES = 64  # images whose features a LocalImageEncoder keeps


class ImageError(ValueError):
    """Bytes that are not an image this encoder can read; the message says what is wrong."""


class ImageEncoder(Protocol):
    @property
    def prompt(self) -> ImagePrompt: ...  # how the checkpoint's processor writes an image into a prompt

    # -> digest, [tokens, hidden] of the image (crop 0) or its crop-th pan-and-scan crop
    def features(self, data: bytes, crop: int = 0) -> tuple[str, torch.Tensor]: ...


Encode = Callable[[Any], list[torch.Tensor]]  # a PIL image -> the features [tokens, hidden] of it and its crops


def gemma3_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Gemma 3: the template's begin-of-image mark becomes a blank line, begin, mm_tokens_per_image placeholders,
    end and a blank line (Gemma3Processor); transformers' PIL image processor, then the SigLIP tower."""
    from transformers import AutoImageProcessor  # imported by a target that serves images only

    from tandem.models.gemma3_vision import load_gemma3_image_encoder

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    encoder = load_gemma3_image_encoder(model_dir, dtype, device)
    begin = hf.get("boi_token_index", 255_999)
    count = FixedCount(hf.get("mm_tokens_per_image", 256))
    image, end = hf.get("image_token_index", 262_144), hf.get("eoi_token_index", 256_000)
    crops = pan_and_scan(processor)
    prompt = ImagePrompt(begin, image, begin, end, "\n\n", count, crops)
    # The crops' settings as announced (the processor leaves unset ones to Gemma3Processor's defaults).
    settings = {} if crops is None else {f"pan_and_scan_{name}": value for name, value in asdict(crops).items()}

    def encode(image: Any) -> list[torch.Tensor]:
        # The image, then its pan-and-scan crops (none unless the processor asks for them).
        pixels = processor(images=[image], return_tensors="pt", **settings)["pixel_values"]
        return list(encoder(pixels.to(device)))

    return prompt, encode


def pan_and_scan(processor: Any) -> PanAndScan | None:
    """Gemma 3's image processor's pan-and-scan settings (Gemma3Processor's defaults where it leaves them unset);
    None where it makes no crops."""
    if not processor.do_pan_and_scan:
        return None
    return PanAndScan(
        processor.pan_and_scan_min_crop_size or 256,
        processor.pan_and_scan_max_num_crops or 4,
        processor.pan_and_scan_min_ratio_to_activate or 1.2,
    )


def gemma4_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Gemma 4: transformers' PIL image processor (resized to the soft-token budget), then the 2-D rope tower."""
    from transformers import AutoImageProcessor

    from tandem.models.gemma4_image_tokens import gemma4_image_prompt, read_budget
    from tandem.models.gemma4_vision import load_gemma4_image_encoder

    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    encoder = load_gemma4_image_encoder(model_dir, dtype, device)

    def encode(image: Any) -> list[torch.Tensor]:
        inputs = processor(images=[image], return_tensors="pt")
        return encoder(inputs["pixel_values"].to(device), inputs["image_position_ids"].to(device))[:1]

    return gemma4_image_prompt(hf, read_budget(model_dir)), encode


def kimi_tower(model_dir: Path, hf: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[ImagePrompt, Encode]:
    """Kimi-K2.5: its image processor in plain torch (tandem.models.kimi_image_processor), then MoonViT."""
    from tandem.models.kimi_image_processor import KimiImageProcessor, kimi_image_prompt
    from tandem.models.kimi_vision import load_kimi_image_encoder

    processor = KimiImageProcessor.from_pretrained(model_dir)
    encoder = load_kimi_image_encoder(model_dir, dtype, device)

    def encode(image: Any) -> list[torch.Tensor]:
        inputs = processor(images=[image], return_tensors="pt")
        return [encoder(inputs["pixel_values"].to(device), inputs["image_grid_thw"])]

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
    def __init__(self, prompt: ImagePrompt, encode: Encode) -> None:
        self.prompt = prompt
        self.encode = encode  # runs on the tower's device
        self._cache: OrderedDict[str, list[torch.Tensor]] = OrderedDict()  # the image's and its crops'

    def features(self, data: bytes, crop: int = 0) -> tuple[str, torch.Tensor]:
        digest = hashlib.sha256(data).hexdigest()
        found = self._cache.get(digest)
        if found is None:
            found = self._encoded(data)
            self._cache[digest] = found
            if len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(digest)
        if not 0 <= crop < len(found):
            raise ImageError(f"crop {crop} of an image with {len(found) - 1} pan-and-scan crops")
        return digest, found[crop]

    def _encoded(self, data: bytes) -> list[torch.Tensor]:
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
    return LocalImageEncoder(*towers[0](model_dir, hf, dtype, device))
