"""Quantized checkpoints, dequantized at load to the serving dtype (keeping them quantized on the device is later
work). The loader (tandem.weights.loader.iter_tensors) hands every checkpoint tensor through `dequantized`, which
replaces each quantized module's stored parts by one `X.weight` that the name maps and shard specs then treat as any
float weight. Two formats, as the releases ship them:

- block-wise fp8 (`quant_method: fp8`, DeepSeek-V3 and Kimi-K2): `X.weight` float8 e4m3 [rows, cols] and
  `X.weight_scale_inv` float32 [ceil(rows / bh), ceil(cols / bw)] for `weight_block_size: [bh, bw]`;
  w[i, j] = fp8[i, j] * scale_inv[i // bh, j // bw], edge blocks partial (DeepSeek's own dequantization).
- compressed-tensors pack-quantized INT4, group-wise and symmetric (`quant_method: compressed-tensors`, Kimi-K2.5's
  routed experts): `X.weight_packed` int32 [rows, ceil(cols / 8)], `X.weight_scale` [rows, ceil(cols / group)],
  `X.weight_shape` [2]. Column c of a row is the 4 bits at 4 * (c % 8) of word c // 8 (least significant first),
  stored as q + 8 for q in -8..7; w[r, c] = q * scale[r, c // group]. There is no zero point (symmetric).
A module is quantized when its marker tensor (`weight_scale_inv`, `weight_packed`) is present; others keep their
float `X.weight` (norms, routers, embeddings, and what the release leaves unquantized).

Each format also says what its stored parts are for a weight of a given shape (`stored_shapes`) and how many of the
weight's rows and columns one stored element covers (`cells`), which is what a rank's slice of the stored form takes
(tandem.models.memory_plan). `grouped` gathers a module's parts, on tensors or on headers alone: the loader and
the plan see one grouping.

Values are computed in float32 and then cast to the serving dtype. For INT4 the float32 product is exact, so at the
scales' own dtype (bfloat16 for Kimi-K2.5) this equals compressed-tensors' decompression; for fp8 it is transformers'
and DeepSeek's (a float32 product, then the cast).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from tandem.errors import StartupError
from tandem.parallel.layers import ShardSpec

LOG = logging.getLogger(__name__)

INT4_PER_WORD = 8  # compressed-tensors packs 8 four-bit values into one int32 word
# A part's cells: the weight rows and columns one stored element covers; None: the part is stored whole on every rank.
Cells = tuple[int, int] | None


class QuantizationError(StartupError):
    """A quantized checkpoint that Tandem cannot dequantize; the message names the field or tensor."""


class Stored(Protocol):
    """A checkpoint tensor not read yet (tandem.weights.loader.StoredTensor)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name of the stored dtype, e.g. "F8_E4M3", "BF16", "I32"

    def read(self, spec: ShardSpec | None = None) -> torch.Tensor: ...


class DequantizedTensor:
    """A quantized module's weight as the loader sees it: its float shape, and a read of the whole tensor or of one
    slice (the whole tensor is dequantized, then sliced: a shard's rows need not align with the blocks or groups)."""

    def __init__(self, shape: tuple[int, ...], dequantize: Callable[[], torch.Tensor], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = str(dtype)
        self._dequantize = dequantize
        self._serving_dtype = dtype

    def read(self, spec: ShardSpec | None = None) -> torch.Tensor:
        weight = self._dequantize().to(self._serving_dtype)
        if spec is None or spec.size is None:
            return weight
        return weight.narrow(spec.dim, spec.start, spec.size)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[rows, cols] fp8 and [ceil(rows / bh), ceil(cols / bw)] scales -> [rows, cols] float32."""
    rows, cols = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scales


def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, words] int32, 8 values a word, least significant nibble first, each stored as q + 8 ->
    [rows, columns] int8 q in -8..7. Example: word 0x0000_00F1 holds q = 1 - 8 = -7 in column 0, 15 - 8 = 7 in
    column 1 and 0 - 8 = -8 in columns 2..7."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)  # [8]
    nibbles = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [rows, words, 8]
    return (nibbles.flatten(1)[:, :columns] - 8).to(torch.int8)


def dequantize_packed_int4(packed: torch.Tensor, scale: torch.Tensor, shape: Sequence[int], group: int) -> torch.Tensor:
    """compressed-tensors' symmetric group-wise INT4 -> [rows, cols] float32."""
    cols = int(shape[1])
    values = unpack_int4(packed, cols).float()  # [rows, cols]
    scales = scale.float().repeat_interleave(group, dim=1)[:, :cols]
    return values * scales


@dataclass(frozen=True)
class BlockFp8:
    block: tuple[int, int]  # weight_block_size: rows, columns
    marker: str = "weight_scale_inv"
    parts: tuple[str, ...] = ("weight", "weight_scale_inv")

    def describe(self) -> str:
        return f"block-wise fp8 e4m3 ({self.block[0]}x{self.block[1]} blocks)"

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The parts' shapes for a [rows, cols] weight."""
        grid = tuple(math.ceil(size / block) for size, block in zip(shape, self.block, strict=True))
        return {"weight": shape, "weight_scale_inv": grid}

    def stored_dtypes(self) -> dict[str, str]:
        """The safetensors dtype of each part whose dtype the format fixes (the scales may be any float)."""
        return {"weight": "F8_E4M3"}

    def cells(self) -> dict[str, Cells]:
        """Each part's cells: an fp8 value is one weight value, a scale one block."""
        return {"weight": (1, 1), "weight_scale_inv": self.block}

    def weight(self, prefix: str, parts: dict[str, Stored], dtype: torch.dtype) -> DequantizedTensor:
        weight, scale = parts["weight"], parts["weight_scale_inv"]
        if len(weight.shape) != 2 or weight.dtype != self.stored_dtypes()["weight"]:
            raise QuantizationError(
                f"tensor {prefix}weight: expected a 2-d float8 e4m3 weight, got {weight.dtype} {list(weight.shape)}"
            )
        grid = self.stored_shapes(weight.shape)["weight_scale_inv"]
        if scale.shape != grid:
            raise QuantizationError(
                f"tensor {prefix}weight_scale_inv: expected shape {grid} ({self.describe()} of "
                f"{list(weight.shape)}), got {scale.shape}"
            )
        return DequantizedTensor(
            weight.shape, lambda: dequantize_block_fp8(weight.read(), scale.read(), self.block), dtype
        )


@dataclass(frozen=True)
class PackedInt4:
    group_size: int
    marker: str = "weight_packed"
    parts: tuple[str, ...] = ("weight_packed", "weight_scale", "weight_shape")

    def describe(self) -> str:
        return f"compressed-tensors pack-quantized int4 (symmetric, groups of {self.group_size})"

    def stored_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The parts' shapes for a [rows, cols] weight."""
        rows, cols = shape
        return {
            "weight_packed": (rows, math.ceil(cols / INT4_PER_WORD)),
            "weight_scale": (rows, math.ceil(cols / self.group_size)),
            "weight_shape": (2,),
        }

    def stored_dtypes(self) -> dict[str, str]:
        """The safetensors dtype of each part whose dtype the format fixes (the scales may be any float)."""
        return {"weight_packed": "I32"}

    def cells(self) -> dict[str, Cells]:
        """Each part's cells: a word is 8 values of a row, a scale one group of a row; weight_shape is whole."""
        return {"weight_packed": (1, INT4_PER_WORD), "weight_scale": (1, self.group_size), "weight_shape": None}

    def weight(self, prefix: str, parts: dict[str, Stored], dtype: torch.dtype) -> DequantizedTensor:
        packed, scale = parts["weight_packed"], parts["weight_scale"]
        shape = tuple(int(size) for size in parts["weight_shape"].read().tolist())
        if len(shape) != 2 or packed.dtype != self.stored_dtypes()["weight_packed"]:
            raise QuantizationError(
                f"tensor {prefix}weight_packed: expected int32 words of a 2-d weight, got {packed.dtype} and "
                f"weight_shape {list(shape)}"
            )
        expected_shapes = self.stored_shapes(shape)
        for name, stored in (("weight_packed", packed), ("weight_scale", scale)):
            expected = expected_shapes[name]
            if stored.shape != expected:
                raise QuantizationError(
                    f"tensor {prefix}{name}: expected shape {expected} for weight_shape {list(shape)} "
                    f"({self.describe()}), got {stored.shape}"
                )
        return DequantizedTensor(
            shape, lambda: dequantize_packed_int4(packed.read(), scale.read(), shape, self.group_size), dtype
        )


Quantization = BlockFp8 | PackedInt4
SUPPORTED = "fp8 with weight_block_size, compressed-tensors pack-quantized int4 group-wise symmetric"


def quantization_of(hf: dict[str, Any]) -> Quantization | None:
    """The checkpoint's quantization from config.json (top level, else a multimodal text_config's, where Kimi-K2.5
    keeps it); None when its weights are not quantized. Raises QuantizationError naming what is not supported."""
    text = hf.get("text_config")
    config = hf.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if config is None:
        return None
    if not isinstance(config, dict):
        raise QuantizationError(f"quantization_config: {config!r} is not supported ({SUPPORTED})")
    method = config.get("quant_method")
    if method == "fp8":
        return _block_fp8(config)
    if method == "compressed-tensors":
        return _packed_int4(config)
    raise QuantizationError(f"quantization_config.quant_method: {method!r} is not supported ({SUPPORTED})")


def _block_fp8(config: dict[str, Any]) -> BlockFp8:
    for key, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",))):
        if config.get(key, allowed[0]) not in allowed:
            raise QuantizationError(f"quantization_config.{key}: {config[key]!r} is not supported ({allowed[0]})")
    block = config.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(size, int) and size > 0 for size in block)):
        raise QuantizationError(
            f"quantization_config.weight_block_size: {block!r} is not supported (block-wise fp8 needs [rows, columns])"
        )
    return BlockFp8((block[0], block[1]))


# What Tandem dequantizes of a compressed-tensors weight scheme: each key's only accepted value.
_INT4_WEIGHTS: dict[str, object] = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
_INT4_WEIGHT_DEFAULTS: dict[str, object] = {"dynamic": False, "actorder": None}  # may be left out


def _packed_int4(config: dict[str, Any]) -> PackedInt4:
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError("quantization_config.config_groups: missing (compressed-tensors' weight schemes)")
    for key, expected in (("quantization_status", "compressed"), ("kv_cache_scheme", None)):
        if config.get(key, expected) != expected:
            raise QuantizationError(f"quantization_config.{key}: {config[key]!r} is not supported ({expected!r})")
    group_sizes = {_int4_group_size(name, group, config) for name, group in groups.items()}
    if len(group_sizes) != 1:
        raise QuantizationError(
            f"quantization_config.config_groups: group sizes {sorted(group_sizes)} are not supported (one for all)"
        )
    return PackedInt4(group_sizes.pop())


def _int4_group_size(name: str, group: dict[str, Any], config: dict[str, Any]) -> int:
    """One config group's group size, after refusing anything of its scheme that is not symmetric group-wise INT4."""
    where = f"quantization_config.config_groups.{name}"
    fmt = group.get("format") or config.get("format")
    if fmt != "pack-quantized":
        raise QuantizationError(f"{where}.format: {fmt!r} is not supported (pack-quantized)")
    for activations in ("input_activations", "output_activations"):
        if group.get(activations) is not None:
            raise QuantizationError(f"{where}.{activations}: quantized activations are not supported (W4A16)")
    weights = group.get("weights") or {}
    for key, expected in _INT4_WEIGHTS.items():
        if weights.get(key) != expected:
            raise QuantizationError(f"{where}.weights.{key}: {weights.get(key)!r} is not supported ({expected!r})")
    for key, expected in _INT4_WEIGHT_DEFAULTS.items():
        if weights.get(key, expected) != expected:
            raise QuantizationError(f"{where}.weights.{key}: {weights[key]!r} is not supported ({expected!r})")
    size = weights.get("group_size")
    if not isinstance(size, int) or size < 1:
        raise QuantizationError(f"{where}.weights.group_size: {size!r} is not supported (a positive integer)")
    return size


class Described(Protocol):
    """A checkpoint tensor as far as grouping goes: its safetensors dtype (a Stored, or a header alone)."""

    @property
    def dtype(self) -> str: ...


Part = TypeVar("Part", bound=Described)


@dataclass(frozen=True)
class Grouped(Generic[Part]):
    """One checkpoint tensor as the name maps see it: a float tensor (`parts` {"weight": it}), or a quantized
    module's stored parts under the name of the float weight they stand for (X.weight)."""

    name: str
    parts: dict[str, Part]
    quantized: bool


def grouped(tensors: Sequence[tuple[str, Part]], quantization: Quantization | None, source: str) -> list[Grouped[Part]]:
    """The checkpoint's tensors in its order, each quantized module's parts as one entry at its marker's place.
    Raises QuantizationError naming a missing part, or a float8 tensor that has no scales (which a plain copy would
    silently cast)."""
    by_name = dict(tensors)
    modules: dict[str, dict[str, Part]] = {}  # prefix ("model.layers.3.mlp.up_proj.") -> its parts by part name
    for name in by_name:
        prefix = _marked_prefix(name, quantization)
        if prefix is None:
            continue
        assert quantization is not None
        missing = [prefix + part for part in quantization.parts if prefix + part not in by_name]
        if missing:
            raise QuantizationError(f"tensor {missing[0]}: missing in {source} ({name} says {quantization.describe()})")
        modules[prefix] = {part: by_name[prefix + part] for part in quantization.parts}
    members = {prefix + part for prefix, parts in modules.items() for part in parts}
    described = quantization.describe() if quantization is not None else "none"
    result: list[Grouped[Part]] = []
    for name, tensor in tensors:
        prefix = _marked_prefix(name, quantization)
        if prefix is not None:
            result.append(Grouped(prefix + "weight", modules[prefix], quantized=True))
        elif name not in members:
            if tensor.dtype.startswith("F8"):
                raise QuantizationError(
                    f"tensor {name}: stored as {tensor.dtype} with no scales in {source} (quantization_config: "
                    f"{described})"
                )
            result.append(Grouped(name, {"weight": tensor}, quantized=False))
    return result


def _marked_prefix(name: str, quantization: Quantization | None) -> str | None:
    """The module prefix ("model.layers.3.mlp.up_proj.") when `name` is a quantized module's marker, else None."""
    if quantization is None or not name.endswith("." + quantization.marker):
        return None
    return name.removesuffix(quantization.marker)


def dequantized(
    stored: list[tuple[str, Stored]], quantization: Quantization | None, source: str, dtype: torch.dtype
) -> list[tuple[str, Stored]]:
    """The checkpoint's tensors with each quantized module's parts replaced by its dequantized `X.weight`, in the
    checkpoint's order (at the marker's place); the checks and errors are `grouped`'s and the format's."""
    result: list[tuple[str, Stored]] = []
    weights: list[DequantizedTensor] = []
    for entry in grouped(stored, quantization, source):
        if not entry.quantized:
            result.append((entry.name, entry.parts["weight"]))
            continue
        assert quantization is not None
        weights.append(quantization.weight(entry.name.removesuffix("weight"), entry.parts, dtype))
        result.append((entry.name, weights[-1]))
    if quantization is not None:
        _log_dequantization(source, quantization, weights, dtype)
    return result


def _log_dequantization(
    source: str, quantization: Quantization, weights: list[DequantizedTensor], dtype: torch.dtype
) -> None:
    values = sum(math.prod(weight.shape) for weight in weights)
    size = values * torch.empty((), dtype=dtype).element_size()
    LOG.info(
        "%s: %s checkpoint, dequantizing %d weights at load: %.3f GiB in %s on the device (%d values)",
        source,
        quantization.describe(),
        len(weights),
        size / 2**30,
        str(dtype).removeprefix("torch."),
        values,
    )
