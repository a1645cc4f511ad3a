"""Step-3.5 / Step-3.7 text configuration, translated once from either config.json layout.

Two layouts reach us:
- the hub's text-only `Step3p5ForCausalLM` (model_type "step3p5"): a legacy top-level config whose per-layer lists
  (`layer_types`, `rope_theta`, `partial_rotary_factors`, `swiglu_limits`, `swiglu_limits_shared`) carry one extra
  entry per MTP layer (`num_nextn_predict_layers`), MoE layers named by `moe_layers_enum`, the sliding layers' head
  count in `attention_other_setting`, and aliases (`num_attention_groups`, `moe_num_experts`, `moe_top_k`);
- `Step3p7ForConditionalGeneration` (model_type "step3p7"), whose text model (model_type "step3p5") sits under
  `text_config` as transformers 5.24 writes it: trimmed lists, `mlp_layer_types`, `num_sliding_attention_heads` and
  `per_layer_config`, and `rope_parameters` per layer type.
Both are read as transformers' Step3p7TextConfig reads them (the reference). What transformers would quietly read
otherwise than the checkpoint means (rope values that differ between layers of one type, sliding layers with their own
KV heads or head size, router or gate variants it does not have) and what Tandem does not run are refused with a
ConfigError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.layers.kv_cache import CacheLayout
from tandem.models.config import (
    ConfigError,
    RopeConfig,
    architecture_of,
    checkpoint_dtype,
    eos_token_ids,
    require_int,
)

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer type names
DENSE, SPARSE = "dense", "sparse"  # transformers' mlp_layer_types
FIRST_MOE_LAYER = 3  # transformers' default when neither mlp_layer_types nor moe_layers_enum says

# transformers' Step3p7TextConfig defaults, for keys that a config.json leaves out. Shapes have no default.
HF_DEFAULTS: dict[str, Any] = {
    "head_dim": 128,
    "max_position_embeddings": 128_000,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 8,
    "n_routed_experts": 288,
    "moe_intermediate_size": 1280,
    "share_expert_dim": 1280,
    "moe_router_scaling_factor": 1.0,
    "rope_theta": 10_000.0,
}
# Legacy hub spellings -> transformers' names (Step3p7TextConfig.attribute_map).
ALIASES = {
    "num_attention_groups": "num_key_value_heads",
    "moe_num_experts": "n_routed_experts",
    "num_local_experts": "n_routed_experts",
    "moe_top_k": "num_experts_per_tok",
    "share_expert_dims": "share_expert_dim",
}


@dataclass(frozen=True)
class LayerRope:
    rope: RopeConfig
    rotary_dim: int  # the first rotary_dim dimensions of each head turn (int(head_dim * partial_rotary_factor))


@dataclass(frozen=True)
class Step3p5MoEConfig:
    hidden_size: int
    expert_intermediate_size: int  # moe_intermediate_size
    shared_intermediate_size: int  # share_expert_dim
    num_experts: int  # n_routed_experts
    experts_per_token: int  # num_experts_per_tok
    routed_scaling_factor: float  # moe_router_scaling_factor, on the routed experts' weighted sum


@dataclass(frozen=True)
class Step3p5Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    layer_heads: tuple[int, ...]  # query heads per layer (sliding layers may have more)
    sliding_layers: tuple[bool, ...]
    sliding_window: int | None  # a sliding layer's query sees this many positions, itself included
    moe_layers: tuple[bool, ...]
    ropes: tuple[LayerRope, LayerRope]  # (full layers', sliding layers')
    query_pre_attn_scalar: float  # softmax scale = query_pre_attn_scalar ** -0.5
    swiglu_limits: tuple[float | None, ...]  # per layer, the routed experts' clamp (None: none)
    swiglu_limits_shared: tuple[float | None, ...]  # per layer, the dense MLP's or shared expert's clamp
    moe: Step3p5MoEConfig
    num_nextn_predict_layers: int  # MTP layers stored after the last layer (the target does not read them)

    @property
    def cache_layout(self) -> CacheLayout:
        return CacheLayout(self.num_kv_heads, self.head_dim, self.head_dim)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Step3p5Config:
        architecture = architecture_of(hf)
        text = text_config(hf)
        num_layers = require_int(text, "num_hidden_layers")
        num_mtp = int(text.get("num_nextn_predict_layers") or 0)
        layer_types = _layer_types(text, num_layers, num_mtp)
        hidden_size = require_int(text, "hidden_size")
        head_dim = int(text["head_dim"])
        window = text.get("sliding_window")
        if SLIDING in layer_types and (window is None or int(window) < 1):
            raise ConfigError(f"sliding_window: {window}, but some layers are sliding_attention layers (needs >= 1)")
        scalar = text.get("query_pre_attn_scalar")
        num_experts, experts_per_token = int(text["n_routed_experts"]), int(text["num_experts_per_tok"])
        if not 1 <= experts_per_token <= num_experts:
            raise ConfigError(
                f"num_experts_per_tok: {experts_per_token} (must be in 1..n_routed_experts {num_experts})"
            )
        return cls(
            architecture=architecture,
            vocab_size=require_int(text, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=require_int(text, "intermediate_size"),
            num_layers=num_layers,
            num_kv_heads=require_int(text, "num_key_value_heads"),
            head_dim=head_dim,
            rms_norm_eps=float(text["rms_norm_eps"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(text["tie_word_embeddings"]),
            eos_token_ids=tuple(dict.fromkeys(eos_token_ids(text) + eos_token_ids(hf))),
            torch_dtype=checkpoint_dtype(hf),
            layer_heads=_layer_heads(text, layer_types),
            sliding_layers=tuple(layer_type == SLIDING for layer_type in layer_types),
            sliding_window=None if window is None else int(window),
            moe_layers=_moe_layers(text, num_layers, num_mtp),
            ropes=_ropes(text, layer_types, num_mtp, head_dim),
            query_pre_attn_scalar=float(head_dim if scalar is None else scalar),
            swiglu_limits=_limits(text, "swiglu_limits", num_layers, num_mtp),
            swiglu_limits_shared=_limits(text, "swiglu_limits_shared", num_layers, num_mtp),
            moe=Step3p5MoEConfig(
                hidden_size=hidden_size,
                expert_intermediate_size=int(text["moe_intermediate_size"]),
                shared_intermediate_size=int(text["share_expert_dim"]),
                num_experts=num_experts,
                experts_per_token=experts_per_token,
                routed_scaling_factor=float(text["moe_router_scaling_factor"]),
            ),
            num_nextn_predict_layers=num_mtp,
        )


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's keys with transformers' defaults and names: `text_config` when there is one (Step-3.7),
    else the top level (Step-3.5's hub config). Refuses what Tandem does not run."""
    nested = hf.get("text_config")
    text = dict(hf if nested is None else nested)
    for alias, name in ALIASES.items():
        if alias in text and name not in text:
            text[name] = text[alias]
    text = HF_DEFAULTS | text
    _check_supported(hf, text)
    return text


def _check_supported(hf: dict[str, Any], text: dict[str, Any]) -> None:
    for config in (hf, text):
        quantization = config.get("quantization_config")
        if quantization is not None:
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
            raise ConfigError(f"quantization_config: {method!r} checkpoints are not supported (dequantize first)")
    refusals = {
        "use_bidirectional_attention": "bidirectional attention is not supported (causal only)",
        "attention_bias": "attention biases are not supported (Step-3.5 has none)",
        "mlp_bias": "MLP biases are not supported (Step-3.5 has none)",
        "sparse_attention_config": "sparse (indexer) attention layers are not supported",
    }
    for key, reason in refusals.items():
        if text.get(key):
            raise ConfigError(f"{key}: {reason}")
    if text.get("gating", True) not in (True, "per-head") or text.get("use_head_wise_attn_gate") is False:
        gate = text.get("gating", text.get("use_head_wise_attn_gate"))
        raise ConfigError(f"gating: {gate!r} is not supported (transformers' Step3p7 always has the head-wise gate)")
    # The hub's rope_scaling applies to the full layers only, which is all transformers does with it.
    if text.get("yarn_only_types") not in (None, [FULL]):
        raise ConfigError(f"yarn_only_types: {text['yarn_only_types']} (rope scaling on other than the full layers)")
    # Hub keys for router variants that transformers' Step3p7 does not have (it always runs this router).
    router = {"moe_router_activation": "sigmoid", "use_moe_router_bias": True, "norm_expert_weight": True}
    for key, value in router.items():
        if text.get(key, value) != value:
            raise ConfigError(f"{key}: {text[key]!r} is not supported (Step-3.5's router has {value!r})")
    if not all(text.get("use_rope_layers") or [True]):
        raise ConfigError("use_rope_layers: layers without rope are not supported")


def _trimmed(text: dict[str, Any], key: str, num_layers: int, num_mtp: int) -> list[Any] | None:
    """A per-layer list, without the entries of the MTP layers that legacy configs append; None when absent."""
    value = text.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected a list with one entry per layer, got {value!r}")
    if num_mtp and len(value) == num_layers + num_mtp:
        value = value[:num_layers]
    if len(value) != num_layers:
        raise ConfigError(
            f"{key}: {len(value)} entries for num_hidden_layers {num_layers} (num_nextn_predict_layers {num_mtp})"
        )
    return value


def _layer_types(text: dict[str, Any], num_layers: int, num_mtp: int) -> list[str]:
    layer_types = _trimmed(text, "layer_types", num_layers, num_mtp) or [FULL] * num_layers
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(f"layer_types: {unknown} are not supported ({SLIDING}, {FULL})")
    return layer_types


def _layer_heads(text: dict[str, Any], layer_types: list[str]) -> tuple[int, ...]:
    """Query heads per layer: num_attention_heads, sliding layers num_sliding_attention_heads (legacy:
    attention_other_setting.num_attention_heads), then transformers' per_layer_config overrides."""
    heads = require_int(text, "num_attention_heads")
    other = text.get("attention_other_setting") or {}
    for key, name in (("num_attention_groups", "num_key_value_heads"), ("head_dim", "head_dim")):
        if key in other and int(other[key]) != int(text[name]):
            raise ConfigError(
                f"attention_other_setting.{key}: {other[key]} differs from {name} {text[name]} (sliding layers with "
                "their own KV heads or head size are not supported; transformers reads only their query heads)"
            )
    sliding = text.get("num_sliding_attention_heads") or other.get("num_attention_heads") or heads
    per_layer = [int(sliding) if layer_type == SLIDING else heads for layer_type in layer_types]
    for index, overrides in (text.get("per_layer_config") or {}).items():
        unknown = sorted(set(overrides) - {"num_attention_heads"})
        if unknown or not 0 <= int(index) < len(per_layer):
            raise ConfigError(f"per_layer_config: layer {index} overrides {unknown or 'a layer that does not exist'}")
        per_layer[int(index)] = int(overrides["num_attention_heads"])
    kv_heads = int(text["num_key_value_heads"])
    if any(count % kv_heads for count in per_layer):
        raise ConfigError(f"num_attention_heads: {sorted(set(per_layer))} per layer, not all multiples of {kv_heads}")
    return tuple(per_layer)


def _moe_layers(text: dict[str, Any], num_layers: int, num_mtp: int) -> tuple[bool, ...]:
    mlp_types = _trimmed(text, "mlp_layer_types", num_layers, num_mtp)
    if mlp_types is not None:
        unknown = sorted(set(mlp_types) - {DENSE, SPARSE})
        if unknown:
            raise ConfigError(f"mlp_layer_types: {unknown} are not supported ({DENSE}, {SPARSE})")
        return tuple(kind == SPARSE for kind in mlp_types)
    listed = text.get("moe_layers_enum")
    if listed is None:
        return tuple(index >= FIRST_MOE_LAYER for index in range(num_layers))
    items = listed.split(",") if isinstance(listed, str) else listed
    moe = {int(item) for item in items if str(item).strip()}
    return tuple(index in moe for index in range(num_layers))


def _ropes(text: dict[str, Any], layer_types: list[str], num_mtp: int, head_dim: int) -> tuple[LayerRope, LayerRope]:
    """(full, sliding) rope. transformers >= 5 writes one rope_parameters dict per layer type; the hub's legacy
    config gives rope_theta (one value or one per layer), partial_rotary_factors per layer and rope_scaling for the
    full layers. transformers takes a type's values from its first layer, so lists whose layers of one type
    disagree are refused rather than read one way here and another there."""
    per_type = text.get("rope_parameters")
    if per_type is not None:
        if not all(isinstance(per_type.get(kind), dict) for kind in set(layer_types)):
            raise ConfigError(f"rope_parameters: expected one entry per layer type ({SLIDING}, {FULL}), got {per_type}")
        params = {kind: per_type.get(kind) or {} for kind in (FULL, SLIDING)}
    else:
        num_layers = len(layer_types)
        thetas = text["rope_theta"]
        if not isinstance(thetas, list):
            thetas = [thetas] * num_layers
        thetas = _trimmed({"rope_theta": thetas}, "rope_theta", num_layers, num_mtp) or []
        factors = _trimmed(text, "partial_rotary_factors", num_layers, num_mtp) or [1.0] * num_layers
        params = {kind: {} for kind in (FULL, SLIDING)}
        for kind in set(layer_types):
            values = {(thetas[i], factors[i]) for i, layer_type in enumerate(layer_types) if layer_type == kind}
            if len(values) > 1:
                raise ConfigError(f"rope_theta / partial_rotary_factors: the {kind} layers disagree ({sorted(values)})")
            theta, factor = values.pop()
            params[kind] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
        scaling = text.get("rope_scaling") or {}
        if "type" in scaling and "rope_type" not in scaling:
            raise ConfigError(f"rope_scaling: {scaling} names its rule as 'type'; transformers reads 'rope_type'")
        params[FULL] |= scaling
    full, sliding = (_layer_rope(params[kind], text, head_dim) for kind in (FULL, SLIDING))
    return full, sliding


def _layer_rope(params: dict[str, Any], text: dict[str, Any], head_dim: int) -> LayerRope:
    factor = float(params.get("partial_rotary_factor") or 1.0)
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor: {factor} turns {rotary_dim} of {head_dim} dimensions (needs even)")
    rope = RopeConfig.from_hf({"rope_theta": text["rope_theta"], "rope_parameters": params})
    if rope.rope_type == "proportional":
        raise ConfigError("rope_parameters.rope_type: 'proportional' is not supported for Step-3.5")
    return LayerRope(rope=rope, rotary_dim=rotary_dim)


def _limits(text: dict[str, Any], key: str, num_layers: int, num_mtp: int) -> tuple[float | None, ...]:
    """A clamp per layer; 0 or null means none, as in transformers."""
    limits = _trimmed(text, key, num_layers, num_mtp) or [None] * num_layers
    return tuple(float(limit) if limit else None for limit in limits)


def mtp_layers_config(hf: dict[str, Any]) -> Step3p5Config:
    """The MTP layers stored after the last layer (`model.layers.{L + k}`) as a model of num_nextn_predict_layers
    layers: layer k's attention kind, query heads, dense or MoE MLP and SwiGLU clamps, with the target's shapes and
    ropes. They are read from transformers' `mtp_layer_types` / `mtp_mlp_layer_types` when the config has them, else
    from the padded entries L + k of the legacy per-layer lists (`layer_types`, `mlp_layer_types` or
    `moe_layers_enum`, `swiglu_limits`, `swiglu_limits_shared`); without either a layer is a full-attention dense
    layer with no clamp. A sliding MTP layer has the sliding layers' query heads, as in the authors' serving code."""
    target = Step3p5Config.from_hf(hf)
    text = text_config(hf)
    num_layers, num_mtp = target.num_layers, target.num_nextn_predict_layers
    if num_mtp < 1:
        raise ConfigError(f"num_nextn_predict_layers: {num_mtp}; the checkpoint has no MTP layers")
    layer_types = text.get("mtp_layer_types") or _padding(text, "layer_types", num_layers, num_mtp) or [FULL] * num_mtp
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown or len(layer_types) != num_mtp:
        raise ConfigError(f"mtp_layer_types: {layer_types} (one of {SLIDING}, {FULL} per MTP layer)")
    mlp_types = text.get("mtp_mlp_layer_types") or _padding(text, "mlp_layer_types", num_layers, num_mtp)
    if mlp_types is not None:
        moe_layers = tuple(kind == SPARSE for kind in mlp_types)
    else:
        listed = text.get("moe_layers_enum") or ""
        items = listed.split(",") if isinstance(listed, str) else listed
        moe = {int(item) for item in items if str(item).strip()}
        moe_layers = tuple(num_layers + index in moe for index in range(num_mtp))
    heads = int(text["num_attention_heads"])
    sliding_heads = int(
        text.get("num_sliding_attention_heads")
        or (text.get("attention_other_setting") or {}).get("num_attention_heads")
        or heads
    )

    def limits(key: str) -> tuple[float | None, ...]:
        values = _padding(text, key, num_layers, num_mtp) or [None] * num_mtp
        return tuple(float(limit) if limit else None for limit in values)

    return replace(
        target,
        num_layers=num_mtp,
        layer_heads=tuple(sliding_heads if kind == SLIDING else heads for kind in layer_types),
        sliding_layers=tuple(kind == SLIDING for kind in layer_types),
        moe_layers=moe_layers,
        swiglu_limits=limits("swiglu_limits"),
        swiglu_limits_shared=limits("swiglu_limits_shared"),
        num_nextn_predict_layers=0,
    )


def _padding(text: dict[str, Any], key: str, num_layers: int, num_mtp: int) -> list[Any] | None:
    """The MTP layers' entries of a per-layer list padded for them (legacy configs); None when not padded."""
    value = text.get(key)
    if isinstance(value, list) and len(value) == num_layers + num_mtp:
        return value[num_layers:]
    return None
