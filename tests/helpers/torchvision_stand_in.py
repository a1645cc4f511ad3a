"""transformers' own Kimi-K2.5 image processor, runnable where torchvision is not installed.

transformers ships Kimi-K2.5's image processor on its torchvision backend only, and the module imports torchvision's
functional transforms when it loads. Tests install a stand-in `torchvision.transforms.v2.functional` for as long as
the context lasts: the four calls that processor makes on an RGB image (resize, pad, normalize, and the
InterpolationMode names), each doing what torchvision 0.2x does on a CPU tensor. Everything else (the patch budget
and resize rule, grouping, padding sizes, the fused rescale and normalize, patchify, grid_thw, the placeholder
count) is transformers' code, run as is.

torchvision's facts restated here (torchvision/transforms/v2/functional/_geometry.py and _misc.py):
- resize of a uint8 image on the CPU with BICUBIC: no resize when the size is unchanged, else torch's
  `interpolate(mode="bicubic", align_corners=False, antialias=True)` on the uint8 tensor itself (its native uint8
  kernel), no float round trip;
- pad with a constant fill: torch's `pad` on the last two dims, padding given as (left, top, right, bottom);
- normalize: (image - mean) / std, mean and std as [channels, 1, 1] tensors of the image's dtype.
"""

from __future__ import annotations

import enum
import importlib
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")
KIMI_MODULES = ("transformers.models.kimi_k25.image_processing_kimi_k25",)


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def resize(
    image: torch.Tensor, size: Sequence[int], interpolation: InterpolationMode, antialias: bool = True
) -> torch.Tensor:  # [..., channels, height, width] uint8
    if interpolation is not InterpolationMode.BICUBIC or image.dtype != torch.uint8 or image.device.type != "cpu":
        raise NotImplementedError(f"the stand-in resizes uint8 CPU images with BICUBIC only, not {interpolation}")
    height, width = size
    if (height, width) == tuple(image.shape[-2:]):
        return image
    *batch, channels, old_height, old_width = image.shape
    flat = image.reshape(-1, channels, old_height, old_width)
    resized = F.interpolate(flat, size=[height, width], mode="bicubic", align_corners=False, antialias=antialias)
    return resized.reshape(*batch, channels, height, width)


def pad(image: torch.Tensor, padding: Sequence[int], fill: float = 0, padding_mode: str = "constant") -> torch.Tensor:
    if padding_mode != "constant":
        raise NotImplementedError(f"the stand-in pads with a constant only, not {padding_mode}")
    left, top, right, bottom = padding
    return F.pad(image, (left, right, top, bottom), value=fill)


def normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
    image = image.sub_(mean) if inplace else image.sub(mean)
    return image.div_(std)


def _stand_in_modules() -> dict[str, ModuleType]:
    modules = {}
    for name in MODULES:
        module = ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
        modules[name] = module
    functional = modules["torchvision.transforms.v2.functional"]
    for name, value in (
        ("InterpolationMode", InterpolationMode),
        ("resize", resize),
        ("pad", pad),
        ("normalize", normalize),
    ):
        setattr(functional, name, value)
    modules["torchvision.transforms.v2"].functional = functional  # type: ignore[attr-defined]
    return modules


@contextmanager
def transformers_kimi_image_processing() -> Iterator[ModuleType]:
    """transformers' `image_processing_kimi_k25` module, loaded and runnable over the stand-in until the context
    ends; then the stand-in and the module are gone from sys.modules again."""
    from transformers import image_processing_backends
    from transformers.image_utils import PILImageResampling

    with pytest.MonkeyPatch.context() as patch:
        for name, module in _stand_in_modules().items():
            patch.setitem(sys.modules, name, module)
        patch.setattr(image_processing_backends, "tvF", sys.modules[MODULES[-1]], raising=False)
        mapping = {PILImageResampling.BICUBIC: InterpolationMode.BICUBIC}
        patch.setattr(image_processing_backends, "pil_torch_interpolation_mapping", mapping, raising=False)
        for name in KIMI_MODULES:
            patch.delitem(sys.modules, name, raising=False)
        try:
            yield importlib.import_module(KIMI_MODULES[0])
        finally:
            for name in KIMI_MODULES:
                sys.modules.pop(name, None)


def transformers_kimi_processor(image_processor: Any, tokenizer: Any) -> Any:
    """transformers' `Kimi_K25Processor` over `image_processor` and `tokenizer`, for images only: built without a
    video processor, whose class check needs torchvision's video classes (the check is skipped for the build)."""
    from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Kimi_K25Processor, "check_argument_for_proper_class", lambda *_: None)
        return Kimi_K25Processor(image_processor=image_processor, tokenizer=tokenizer)
