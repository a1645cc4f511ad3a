"""Kimi-K2.5's image preprocessing and its placeholder count, as transformers' Kimi-K2.5 processor has them.

transformers ships Kimi-K2.5's image processor (`Kimi_K25ImageProcessor`) on its torchvision backend only: there is
no PIL one, and its module imports torchvision when it loads, which cannot be installed beside the CPU torch here
(the registry serves CUDA builds). `KimiImageProcessor` is that processor's `_preprocess` written over torch
operations alone, on transformers' own image-processor machinery (`PilBackend`: preprocessor_config.json and its
kwargs, the RGB conversion of a PIL image, BatchFeature). Each step does what the torchvision backend does on a
CPU, which is where a processor's input lies:
- the size (`PatchBudget.sizes`): scale down, never up, to at most `max_patches` patches and `size["max_height"]`
  patches a side, then pad at the bottom and right to whole `merge_size` x `merge_size` windows of patches;
- the resize: torchvision resizes a uint8 image on the CPU with BICUBIC by torch's own uint8 kernel,
  `F.interpolate(mode="bicubic", antialias=True)` on the uint8 tensor, which is the call made here (transformers'
  PIL backend would differ: Pillow's bicubic is off by up to 6 of 255 on some pixels);
- the pad with zeros, then rescale and normalize fused, (x - mean / rescale_factor) / (std / rescale_factor) in
  float32, as transformers' torchvision backend computes it;
- patchify: the image cut into patches row by row, [h * w, 3, patch, patch], and its grid (1, h, w).
So the pixels equal transformers' processor's bit for bit wherever torchvision runs on the CPU (checked against
transformers' own class in tests/unit/test_kimi_vision.py, with a stand-in for torchvision's three calls). Another
way kept out: a fake torchvision module installed at run time, so that transformers' class imports; that would
patch transformers' globals in a serving process.

Placeholders: Kimi-K2.5's chat template writes an image as `<|media_begin|>image<|media_content|><|media_pad|>
<|media_end|>` (no break), and transformers' `Kimi_K25Processor` repeats `<|media_pad|>` (image_token_id) once per
merge window: grid h * w / merge_size^2 times (`kimi_image_prompt`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, PILImageResampling
from transformers.processing_utils import ImagesKwargs

from tandem.models.config import ConfigError
from tandem.models.image_prompt import ImagePrompt, PatchBudget


def kimi_image_prompt(hf: dict[str, Any], budget: PatchBudget) -> ImagePrompt:
    """A Kimi-K2.5 config.json's placeholder (transformers' Kimi_K25Config default where it leaves it out): the
    template writes begin, the text "image", <|media_content|>, one placeholder and end; the processor repeats the
    placeholder once per merge window."""
    image = hf.get("image_token_id", 163_605)
    return ImagePrompt(image, image, None, None, "", budget)


class KimiImagesKwargs(ImagesKwargs, total=False):
    max_patches: int
    patch_size: int
    merge_size: int


class KimiImageProcessor(PilBackend):
    """transformers' Kimi_K25ImageProcessor, its defaults and kwargs, over torch alone (see the module docstring)."""

    do_resize = True
    resample = PILImageResampling.BICUBIC
    size = {"max_height": 512, "max_width": 512}  # noqa: RUF012 - transformers reads it as a class attribute
    max_patches = 16384
    do_rescale = True
    do_normalize = True
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    do_convert_rgb = True
    patch_size = 14
    merge_size = 2
    valid_kwargs = KimiImagesKwargs
    model_input_names = ["pixel_values", "image_grid_thw"]  # noqa: RUF012 - as above

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        checked_budget(**self._merge_and_standardize_kwargs())  # settings refused at load, not at the first image

    @property
    def budget(self) -> PatchBudget:
        return PatchBudget(self.patch_size, self.merge_size, self.max_patches, self.size["max_height"])

    def _preprocess(self, images: list[np.ndarray], **kwargs: Any) -> BatchFeature:  # type: ignore[override]
        """Images [3, height, width] (uint8, as PilBackend hands them over) -> pixel_values [patches, 3, patch,
        patch], the images one after the other, and image_grid_thw [images, 3]."""
        budget = checked_budget(**kwargs)
        rows, grids = [], []
        for image in images:
            pixels = torch.from_numpy(image)
            if kwargs["do_resize"]:
                resized, padded = budget.sizes(*pixels.shape[-2:])
                pixels = padded_to(resized_to(pixels, resized), padded)
            pixels = rescaled_normalized(pixels, **kwargs)
            patches, grid = patchified(pixels, budget.patch_size)
            rows.append(patches)
            grids.append((1, *grid))
        values = {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
        return BatchFeature(data=values, tensor_type=kwargs["return_tensors"])


def checked_budget(**kwargs: Any) -> PatchBudget:
    """The patch budget of a preprocess call's settings; refuses those transformers' processor refuses or that would
    resize other than Kimi-K2.5's way."""
    size, resample = kwargs["size"], kwargs["resample"]
    if size.max_height is None or size.max_height != size.max_width:
        raise ConfigError(f"size: {size} has no max_height equal to its max_width (patches a side)")
    if kwargs["do_resize"] and resample != PILImageResampling.BICUBIC:
        raise ConfigError(f"resample: {resample}; Kimi-K2.5 resizes with bicubic ({PILImageResampling.BICUBIC})")
    return PatchBudget(kwargs["patch_size"], kwargs["merge_size"], kwargs["max_patches"], size.max_height)


def resized_to(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:  # [3, H, W] -> [3, *size]
    if tuple(pixels.shape[-2:]) == size:
        return pixels  # torchvision leaves an image of the asked size as it is
    return F.interpolate(pixels[None], size=list(size), mode="bicubic", align_corners=False, antialias=True)[0]


def padded_to(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:  # [3, H, W] -> [3, *size], zeros
    return F.pad(pixels, (0, size[1] - pixels.shape[-1], 0, size[0] - pixels.shape[-2]))


def rescaled_normalized(pixels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """transformers' torchvision backend's `rescale_and_normalize`: both fused into one normalize in float32."""
    mean, std, scale = kwargs["image_mean"], kwargs["image_std"], kwargs["rescale_factor"]
    if kwargs["do_normalize"]:
        if kwargs["do_rescale"]:
            mean, std = torch.tensor(mean) * (1.0 / scale), torch.tensor(std) * (1.0 / scale)
        mean, std = torch.as_tensor(mean, dtype=torch.float32), torch.as_tensor(std, dtype=torch.float32)
        return (pixels.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    if kwargs["do_rescale"]:
        return pixels * scale
    return pixels


def patchified(pixels: torch.Tensor, patch: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """[channels, H, W] -> [H / patch * W / patch, channels, patch, patch], patches row by row, and (rows, columns)."""
    channels, height, width = pixels.shape
    rows, columns = height // patch, width // patch
    patches = pixels.reshape(channels, rows, patch, columns, patch).permute(1, 3, 0, 2, 4)
    return patches.reshape(rows * columns, channels, patch, patch), (rows, columns)
