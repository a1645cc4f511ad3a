"""Gemma 4 text configuration (Gemma4ForCausalLM, model_type gemma4_text), translated once from config.json.

What a Gemma 4 config says that Gemma 3's does not, each read here into one field:
- full (global) layers have their own head dim and KV head count. The hub files give `global_head_dim` (default 512)
  and `num_global_key_value_heads` (which transformers applies only with `attention_k_eq_v`); transformers' own
  save writes them as `per_layer_config` {layer index: {head_dim, num_key_value_heads}}. Both are read; a layer
  named in neither has the top-level head_dim and num_key_value_heads;
- `attention_k_eq_v`: full layers have no v_proj, their values are the key projection (see gemma4_layers);
- rope per layer type, the full layers' usually "proportional" with a partial rotary factor;
- per-layer input embeddings (`hidden_size_per_layer_input`, 0 or null for none);
- `num_kv_shared_layers`: the last n layers keep no K/V of their own and attend over the KV of the last earlier
  layer of their type (the "store" layer); with `use_double_wide_mlp` their MLPs are twice as wide;
- `enable_moe_block`: every layer adds routed experts to its dense MLP.
transformers forces the last layer to be a full layer (with a warning); so does this translation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tandem.layers.kv_cache import CacheLayout
from tandem.layers.mlp import ACTIVATIONS
from tandem.models.config import (
    ConfigError,
    GroupedQueryConfig,
    RopeConfig,
)
from tandem.models.gemma3 import gemma_fields

LOG = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer type names
# transformers' Gemma4TextConfig defaults, for keys that a config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "global_head_dim": 512,
}
DEFAULT_ROPES: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # what a per_layer_config entry may set


@dataclass(frozen=True)
class Gemma4LayerSpec:
    sliding: bool
    head_dim: int
    num_kv_heads: int
    kv_source: int  # the layer whose KV cache this layer attends over: itself, or the store layer of a KV-shared one
    values_from_keys: bool  # attention_k_eq_v on a full layer: V = v_norm(k_proj(x)), no v_proj
    intermediate_size: int  # its dense MLP's (doubled on KV-shared layers with use_double_wide_mlp)


@dataclass(frozen=True)
class Gemma4MoEConfig:
    num_experts: int
    experts_per_token: int  # top_k_experts
    expert_intermediate_size: int  # moe_intermediate_size


@dataclass(frozen=True)
class Gemma4Config(GroupedQueryConfig):
    """Top-level head_dim, num_kv_heads and intermediate_size are the plain (sliding) layers'; `layers` has each
    layer's own."""

    hidden_activation: str
    attention_bias: bool
    sliding_window: int
    layers: tuple[Gemma4LayerSpec, ...]
    full_rope: RopeConfig
    sliding_rope: RopeConfig
    final_logit_softcapping: float | None
    per_layer_input_size: int  # hidden_size_per_layer_input; 0: no per-layer input embeddings
    per_layer_vocab_size: int  # vocab_size_per_layer_input
    moe: Gemma4MoEConfig | None
    pad_token_id: int  # an image's tokens take its per-layer inputs
    images_both_ways: bool  # use_bidirectional_attention "vision": an image's tokens see each other on sliding layers

    @property
    def cache_layout(self) -> CacheLayout:
        return kv_row_layout(self.layers, world_size=1)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma4Config:
        hf = HF_DEFAULTS | hf
        _refuse_unsupported(hf)
        layer_types = _layer_types(hf)
        layers = _layer_specs(hf, layer_types)
        softcap = hf.get("final_logit_softcapping")
        return cls(
            **gemma_fields(hf, len(layers)),
            sliding_window=int(hf["sliding_window"]),
            layers=layers,
            full_rope=_rope(hf, FULL),
            sliding_rope=_rope(hf, SLIDING),
            final_logit_softcapping=None if softcap is None else float(softcap),
            per_layer_input_size=int(hf["hidden_size_per_layer_input"] or 0),
            per_layer_vocab_size=int(hf["vocab_size_per_layer_input"]),
            moe=_moe(hf),
            pad_token_id=int(hf.get("pad_token_id") or 0),
            images_both_ways=hf.get("use_bidirectional_attention") == "vision",
        )


def kv_row_layout(layers: tuple[Gemma4LayerSpec, ...], world_size: int) -> CacheLayout:
    """One KV-cache row per token and layer, as wide as the widest layer's K (or V) heads on one rank: a layer views
    the first num_kv_heads * head_dim columns of it as its [num_kv_heads, head_dim] (tandem.models.gemma4_layers).

    Example: sliding layers with 8 KV heads of 256 and full layers with 2 of 512 need rows of 2048 at tp 1 (the full
    layers use the first 1024 columns) and 1024 at tp 2.
    """
    width = max(layer.num_kv_heads // world_size * layer.head_dim for layer in layers)
    return CacheLayout(num_kv_heads=1, key_dim=width, value_dim=width)


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    if hf.get("use_bidirectional_attention") == "all":
        raise ConfigError("use_bidirectional_attention: 'all' (bidirectional text attention) is not supported")
    if hf["hidden_activation"] not in ACTIVATIONS:
        known = ", ".join(ACTIVATIONS)
        raise ConfigError(f"hidden_activation: {hf['hidden_activation']!r} is not supported ({known})")
    if int(hf["sliding_window"]) < 1:
        raise ConfigError(f"sliding_window: {hf['sliding_window']} (needs >= 1)")


def _layer_types(hf: dict[str, Any]) -> list[str]:
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers' default: every 6th layer is a full layer
        layer_types = [SLIDING if (index + 1) % 6 else FULL for index in range(num_layers)]
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(
            f"layer_types: {unknown} are not Gemma 4 layer types ({SLIDING}, {FULL}): Tandem has no attention for them"
        )
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types: {len(layer_types)} entries for num_hidden_layers {num_layers}")
    if layer_types[-1] != FULL:
        LOG.warning("layer_types: the last layer is %r; transformers makes it a full layer, and so does Tandem", FULL)
        layer_types = [*layer_types[:-1], FULL]
    return list(layer_types)


def _full_layer_overrides(hf: dict[str, Any], layer_types: list[str]) -> dict[int, dict[str, Any]]:
    """Per layer index, what differs from the top-level head_dim and num_key_value_heads (see the module docstring)."""
    saved = hf.get("per_layer_config")
    if saved is not None:
        overrides = {int(index): dict(values) for index, values in saved.items()}
        for index, values in overrides.items():
            unknown = sorted(set(values) - set(_LAYER_OVERRIDES))
            if unknown:
                raise ConfigError(f"per_layer_config: layer {index} sets {unknown}; only {list(_LAYER_OVERRIDES)} can")
        return overrides
    full: dict[str, Any] = {"head_dim": hf["global_head_dim"]}
    if hf["attention_k_eq_v"] and hf.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = hf["num_global_key_value_heads"]
    return {index: full for index, layer_type in enumerate(layer_types) if layer_type == FULL}


def _kv_sources(hf: dict[str, Any], layer_types: list[str]) -> list[int]:
    """Per layer, the layer whose KV it attends over: itself, or for the last num_kv_shared_layers layers the last
    layer of the same type before them. Example: types [s, s, f, s, f], 2 shared -> sources [0, 1, 2, 1, 2]."""
    num_layers, num_shared = len(layer_types), int(hf["num_kv_shared_layers"] or 0)
    first_shared = num_layers - num_shared
    if num_shared < 0 or first_shared < 1:
        raise ConfigError(f"num_kv_shared_layers: {num_shared} leaves no layer to keep K/V among {num_layers}")
    sources = list(range(first_shared))
    for index in range(first_shared, num_layers):
        earlier = [source for source in range(first_shared) if layer_types[source] == layer_types[index]]
        if not earlier:
            raise ConfigError(
                f"num_kv_shared_layers: {num_shared} shares layer {index} ({layer_types[index]}), but no earlier layer "
                "of that type keeps K/V"
            )
        sources.append(earlier[-1])
    return sources


def _layer_specs(hf: dict[str, Any], layer_types: list[str]) -> tuple[Gemma4LayerSpec, ...]:
    overrides = _full_layer_overrides(hf, layer_types)
    sources = _kv_sources(hf, layer_types)
    specs = []
    for index, (layer_type, source) in enumerate(zip(layer_types, sources, strict=True)):
        values = overrides.get(index, {})
        wide = bool(hf["use_double_wide_mlp"]) and source != index
        specs.append(
            Gemma4LayerSpec(
                sliding=layer_type == SLIDING,
                head_dim=int(values.get("head_dim", hf["head_dim"])),
                num_kv_heads=int(values.get("num_key_value_heads", hf["num_key_value_heads"])),
                kv_source=source,
                values_from_keys=bool(hf["attention_k_eq_v"]) and layer_type == FULL,
                intermediate_size=int(hf["intermediate_size"]) * (2 if wide else 1),
            )
        )
    for sliding in (True, False):  # one rotary table per layer type, as transformers has
        dims = {spec.head_dim for spec in specs if spec.sliding == sliding}
        if len(dims) > 1:
            raise ConfigError(f"per_layer_config: head dims {sorted(dims)} within one layer type are not supported")
    for index, spec in enumerate(specs):
        store = specs[spec.kv_source]
        if (spec.head_dim, spec.num_kv_heads) != (store.head_dim, store.num_kv_heads):
            raise ConfigError(
                f"per_layer_config: layer {index} shares the KV of layer {spec.kv_source} of another shape"
            )
    return tuple(specs)


def _rope(hf: dict[str, Any], layer_type: str) -> RopeConfig:
    per_type = hf.get("rope_parameters") or DEFAULT_ROPES
    if layer_type not in per_type:
        raise ConfigError(f"rope_parameters: no entry for {layer_type} (expected one per layer type)")
    return RopeConfig.from_hf({"rope_parameters": per_type[layer_type]})


def _moe(hf: dict[str, Any]) -> Gemma4MoEConfig | None:
    if not hf["enable_moe_block"]:
        return None
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if hf.get(key) is None:
            raise ConfigError(f"{key}: missing from config.json, and enable_moe_block needs it")
    return Gemma4MoEConfig(
        num_experts=int(hf["num_experts"]),
        experts_per_token=int(hf["top_k_experts"]),
        expert_intermediate_size=int(hf["moe_intermediate_size"]),
    )
