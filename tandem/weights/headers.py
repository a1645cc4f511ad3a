"""A checkpoint's tensors as its safetensors headers list them: names, dtypes, shapes and sizes, no tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the data. The JSON maps each
tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data section), plus an optional
"__metadata__" of strings. Only the first 8 + N bytes are read here, so a file whose data section is missing or
unreadable still lists its tensors (`tandem plan` reads nothing else).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.weights.loader import CheckpointError, checkpoint_files

# Bytes per element of safetensors' dtypes, to check each entry's offsets; a dtype not listed (sub-byte floats) is
# taken at its offsets' span unchecked.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# safetensors itself refuses headers over 100 MB; a larger length is a file of another kind.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors' name, e.g. "BF16", "F8_E4M3", "I32"
    shape: tuple[int, ...]
    nbytes: int  # the tensor's bytes in the file (its data offsets' span)


def read_headers(path: Path) -> list[TensorHeader]:
    """The tensors that the file at `path` lists, in the header's order; CheckpointError naming the file when the
    header is not a safetensors header."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: shorter than a safetensors header ({len(prefix)} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: a header of {length} bytes; not a safetensors file")
        text = handle.read(length)
    if len(text) < length:
        raise CheckpointError(f"{path}: the header says {length} bytes, the file holds {len(text)} after the length")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    return [_tensor(path, name, entry) for name, entry in header.items() if name != "__metadata__"]


def _tensor(path: Path, name: str, entry: Any) -> TensorHeader:
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        valid = (
            isinstance(dtype, str)
            and all(isinstance(size, int) and size >= 0 for size in shape)
            and all(isinstance(offset, int) for offset in (begin, end))
            and 0 <= begin <= end
        )
    except (KeyError, TypeError, ValueError):
        valid = False
    if not valid:
        raise CheckpointError(f"tensor {name} in {path}: not a safetensors entry ({entry!r})")
    nbytes = end - begin
    if dtype in DTYPE_BYTES and nbytes != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise CheckpointError(
            f"tensor {name} in {path}: its data offsets span {nbytes} bytes, {dtype} {list(shape)} takes "
            f"{math.prod(shape) * DTYPE_BYTES[dtype]}"
        )
    return TensorHeader(name, dtype, tuple(shape), nbytes)


def checkpoint_headers(model_dir: Path) -> list[TensorHeader]:
    """Every tensor of the checkpoint in `model_dir`, file by file, as the loader meets them (tandem.weights.loader)."""
    headers: list[TensorHeader] = []
    for path in checkpoint_files(model_dir):
        if not path.is_file():
            raise CheckpointError(f"{path.name}: listed in model.safetensors.index.json, not found in {model_dir}")
        headers.extend(read_headers(path))
    return headers
