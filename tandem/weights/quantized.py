"""Quantized checkpoints: the format config.json names (`quantization_of`), and each quantized module's stored parts
gathered under the name of the float weight they stand for (`grouped`, on tensors or on headers alone: the loader
and the plan see one grouping). The formats themselves, their parts and values, are tandem.weights.formats.

The loader (tandem.weights.loader) hands every checkpoint tensor through `quantized_entries`, which replaces each
quantized module's parts by one `X.weight`, a QuantizedTensor, that the name maps and shard specs then treat as any
float weight: a layer that keeps it as stored loads its parts (tandem.layers.stored), any other module its float
values. A module is quantized when its marker tensor (`weight_scale_inv`, `weight_packed`) is present; others keep
their float `X.weight` (norms, routers, embeddings, and what the release leaves unquantized).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from tandem.weights.formats import (
    BlockFp8,
    PackedInt4,
    Quantization,
    QuantizationError,
    Stored,
)

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


def quantized_entries(
    stored: list[tuple[str, Stored]], quantization: Quantization | None, source: str, dtype: torch.dtype
) -> list[tuple[str, Stored]]:
    """The checkpoint's tensors with each quantized module's parts replaced by its `X.weight` (a QuantizedTensor whose
    float values come in `dtype`), in the checkpoint's order (at the marker's place); the checks and errors are
    `grouped`'s and the format's."""
    result: list[tuple[str, Stored]] = []
    for entry in grouped(stored, quantization, source):
        if not entry.quantized:
            result.append((entry.name, entry.parts["weight"]))
            continue
        assert quantization is not None
        result.append((entry.name, quantization.weight(entry.name.removesuffix("weight"), entry.parts, dtype)))
    return result
