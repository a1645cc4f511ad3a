"""Checkpoints of full-size models with no tensor data: safetensors files whose headers list every tensor of the
release at its offsets, followed by nothing (or by a few bytes of garbage) instead of the data.

Written by the format's definition (an 8-byte little-endian header length, the JSON header padded with spaces to a
multiple of 8, then the data section), so that `tandem plan` can be checked on a 671B model in a second; anything
that read a tensor from one of these files would fail.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.deepseek_layout import Tensors, deepseek_v3_config, deepseek_v3_tensors

__all__ = ["Tensors", "deepseek_v3_config", "deepseek_v3_tensors", "write_header_only"]

# Bytes per element of the dtypes written here.
ITEM_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def write_header_only(path: Path, tensors: Mapping[str, tuple[str, tuple[int, ...]]], data: bytes = b"") -> int:
    """Writes a safetensors file listing `tensors` one after another, with `data` as its whole data section; returns
    the bytes the listed tensors take."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * ITEM_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return offset
