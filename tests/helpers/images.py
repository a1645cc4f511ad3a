"""Random images as the bytes a request brings, and opened again as a processor takes them."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(height: int, width: int, mode: str = "RGB", seed: int = 0) -> bytes:
    """A random PNG of (height, width) pixels: RGB, RGBA or grey ("L")."""
    channels = {"RGB": (3,), "RGBA": (4,), "L": ()}[mode]
    values = np.random.default_rng(seed).integers(0, 256, (height, width, *channels), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(values, mode).save(data, format="PNG")
    return data.getvalue()


def opened(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image
