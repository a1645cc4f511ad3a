"""Tensors on the wire: dtype name, shape and row-major little-endian raw bytes; never pickle.

Small tensors travel whole in a `Tensor` message. Weight tensors, which can be hundreds of MiB, travel as a
stream of `WeightChunk` messages, each under gRPC's default 4 MiB message limit, with a sha256 of the whole
tensor on the last chunk so that the receiver can check what it assembled.

Copies: sending reads a tensor's bytes once into the `bytes` a protobuf field needs (plus one more copy when the
tensor is not already a contiguous CPU tensor); receiving copies the message's immutable `bytes` once into a
writable buffer that the returned tensor then owns. All conversions are whole-buffer operations.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from tandem.wire import common_pb2, target_pb2

# gRPC refuses messages above 4 MiB by default; 64 KiB of headroom covers the chunk's other fields.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024

_SUPPORTED_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


_DTYPE_BY_NAME: Mapping[str, torch.dtype] = MappingProxyType(
    {str(dtype).removeprefix("torch."): dtype for dtype in _SUPPORTED_DTYPES}
)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: torch's spelling without the "torch." prefix, e.g. "bfloat16"."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BY_NAME:
        raise ValueError(f"unsupported tensor dtype {name!r}; supported: {', '.join(_DTYPE_BY_NAME)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name; ValueError for a name this codec does not carry."""
    dtype = _DTYPE_BY_NAME.get(name)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype {name!r}; supported: {', '.join(_DTYPE_BY_NAME)}")
    return dtype


def _expected_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    if any(size < 0 for size in shape):
        raise ValueError(f"negative size in tensor shape {list(shape)}")
    return math.prod(shape) * dtype.itemsize


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major bytes as a 1-D uint8 tensor on the CPU, sharing memory where possible.

    A copy happens only when it is needed: `.cpu()` for a tensor on an accelerator and `.contiguous()` for a
    non-row-major view (transposed, strided slice).
    """
    # reshape(-1) first: view(uint8) refuses 0-d tensors.
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _read_bytes(flat: torch.Tensor, start: int, length: int) -> bytes:  # flat: [num_bytes] uint8, contiguous CPU
    """Copies flat[start : start + length] into a new bytes object in one memcpy, without numpy."""
    if length == 0:
        # An empty tensor may have no storage at all (data_ptr 0).
        return b""
    # Invariant: flat is a contiguous CPU tensor alive for this call, so the address range is valid memory.
    return ctypes.string_at(flat.data_ptr() + start, length)


def tensor_to_proto(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encodes a tensor of any shape (0-d and empty included) as dtype name, shape and raw bytes."""
    name = dtype_name(tensor.dtype)
    flat = _flat_bytes(tensor)
    return common_pb2.Tensor(dtype=name, shape=list(tensor.shape), data=_read_bytes(flat, 0, flat.numel()))


def _tensor_from_bytes(data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Wraps a buffer whose length is already checked; a bytearray is shared, a bytes object is copied once."""
    if not data:
        # torch.frombuffer refuses an empty buffer.
        return torch.empty(shape, dtype=dtype)
    # torch.frombuffer shares memory with its buffer; tensors must be writable but bytes are immutable,
    # so bytes are first copied into a bytearray that the tensor then keeps alive.
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def tensor_from_proto(message: common_pb2.Tensor) -> torch.Tensor:
    """Decodes a `Tensor` message into a writable CPU tensor that owns its memory."""
    dtype = dtype_from_name(message.dtype)
    shape = tuple(message.shape)
    expected = _expected_bytes(dtype, shape)
    data = message.data
    if len(data) != expected:
        raise ValueError(
            f"tensor of dtype {message.dtype} and shape {list(shape)} needs {expected} bytes, got {len(data)}"
        )
    return _tensor_from_bytes(data, dtype, shape)


@dataclass(frozen=True)
class ShardOf:
    """Where a streamed tensor sits in its table: shard `rank` of `num_shards`, of a table of `vocab_size` rows."""

    rank: int = 0
    num_shards: int = 1
    vocab_size: int = 0  # 0: not a vocabulary table


def iter_weight_chunks(
    name: str, tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES, shard: ShardOf = ShardOf()
) -> Iterator[target_pb2.WeightChunk]:
    """Splits one tensor into `WeightChunk` messages of at most chunk_bytes data bytes each.

    Every chunk carries the name, shard, dtype, shape, its byte offset and the total byte count; the last chunk
    also carries the sha256 hex digest of all bytes. An empty tensor gives a single chunk with no data.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    dtype = dtype_name(tensor.dtype)
    shape = list(tensor.shape)
    # The generator holds flat, so the memory _read_bytes reads stays alive between chunks.
    flat = _flat_bytes(tensor)
    total_bytes = flat.numel()
    digest = hashlib.sha256()
    # max(total_bytes, 1): an empty tensor still gives one chunk.
    for offset in range(0, max(total_bytes, 1), chunk_bytes):
        data = _read_bytes(flat, offset, min(chunk_bytes, total_bytes - offset))
        digest.update(data)
        is_last = offset + len(data) == total_bytes
        yield target_pb2.WeightChunk(
            name=name,
            dtype=dtype,
            shape=shape,
            offset=offset,
            total_bytes=total_bytes,
            data=data,
            sha256=digest.hexdigest() if is_last else "",
            shard_rank=shard.rank,
            num_shards=shard.num_shards,
            vocab_size=shard.vocab_size,
        )


@dataclass(frozen=True)
class AssembledTensor:
    name: str
    shard: ShardOf
    tensor: torch.Tensor


@dataclass
class _PartialTensor:
    """A tensor being assembled: its header as first received, and the bytes so far."""

    label: str
    dtype_name: str
    shape: tuple[int, ...]
    total_bytes: int
    buffer: bytearray
    received: int


class WeightAssembler:
    """Reassembles tensors from `WeightChunk` messages and checks them on the way.

    Chunks of one tensor must arrive in order; chunks of different tensors may interleave. Each tensor's bytes
    are written straight into a buffer allocated once at its full size, which the finished tensor then shares.
    """

    def __init__(self, progress: Callable[[str, int, int], None] | None = None) -> None:
        """progress(name, bytes_received, total_bytes) is called after every chunk."""
        self._progress = progress
        self._partial: dict[tuple[str, int], _PartialTensor] = {}

    def add(self, chunk: target_pb2.WeightChunk) -> AssembledTensor | None:
        """Takes one chunk; returns the tensor when that chunk completes it, else None."""
        name = _label(chunk)
        key = (chunk.name, chunk.shard_rank)
        partial = self._partial.get(key)
        if partial is None:
            partial = self._start(chunk)
        else:
            self._check_same_header(partial, chunk)
        data = chunk.data
        if chunk.offset != partial.received:
            problem = "gap" if chunk.offset > partial.received else "overlap"
            raise ValueError(
                f"weight {name!r}: chunk at offset {chunk.offset} but {partial.received} bytes received ({problem})"
            )
        end = partial.received + len(data)
        if end > partial.total_bytes:
            raise ValueError(
                f"weight {name!r}: chunk at offset {chunk.offset} with {len(data)} bytes overruns "
                f"total_bytes {partial.total_bytes}"
            )
        partial.buffer[partial.received : end] = data
        partial.received = end
        if self._progress is not None:
            self._progress(name, end, partial.total_bytes)
        if end < partial.total_bytes:
            return None
        del self._partial[key]
        actual = hashlib.sha256(partial.buffer).hexdigest()
        if chunk.sha256 != actual:
            raise ValueError(
                f"weight {name!r}: sha256 of the {partial.total_bytes} received bytes is {actual}, "
                f"the sender's last chunk says {chunk.sha256 or '(none)'}"
            )
        shard = ShardOf(chunk.shard_rank, chunk.num_shards or 1, chunk.vocab_size)
        tensor = _tensor_from_bytes(partial.buffer, dtype_from_name(partial.dtype_name), partial.shape)
        return AssembledTensor(chunk.name, shard, tensor)

    def finish(self) -> None:
        """Raises ValueError if any tensor is still incomplete, e.g. because a chunk never arrived."""
        if self._partial:
            incomplete = ", ".join(
                f"{partial.label!r} ({partial.received} of {partial.total_bytes} bytes)"
                for partial in self._partial.values()
            )
            raise ValueError(f"weight stream ended with incomplete tensors: {incomplete}")

    def _start(self, chunk: target_pb2.WeightChunk) -> _PartialTensor:
        shape = tuple(chunk.shape)
        expected = _expected_bytes(dtype_from_name(chunk.dtype), shape)
        if chunk.total_bytes != expected:
            raise ValueError(
                f"weight {_label(chunk)!r}: dtype {chunk.dtype} and shape {list(shape)} need {expected} bytes, "
                f"chunk says total_bytes {chunk.total_bytes}"
            )
        partial = _PartialTensor(
            label=_label(chunk),
            dtype_name=chunk.dtype,
            shape=shape,
            total_bytes=expected,
            buffer=bytearray(expected),
            received=0,
        )
        self._partial[(chunk.name, chunk.shard_rank)] = partial
        return partial

    @staticmethod
    def _check_same_header(partial: _PartialTensor, chunk: target_pb2.WeightChunk) -> None:
        shape = tuple(chunk.shape)
        if (chunk.dtype, shape, chunk.total_bytes) != (partial.dtype_name, partial.shape, partial.total_bytes):
            raise ValueError(
                f"weight {_label(chunk)!r} changed mid-stream: started as dtype {partial.dtype_name}, shape "
                f"{list(partial.shape)}, total_bytes {partial.total_bytes}; chunk at offset {chunk.offset} says "
                f"dtype {chunk.dtype}, shape {list(shape)}, total_bytes {chunk.total_bytes}"
            )


def _label(chunk: target_pb2.WeightChunk) -> str:
    """How a tensor is named in messages: "lm_head", or "lm_head shard 1 of 2" for a table sent in shards."""
    return chunk.name if chunk.num_shards <= 1 else f"{chunk.name} shard {chunk.shard_rank} of {chunk.num_shards}"
