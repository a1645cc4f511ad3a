"""Our own model configuration, translated once from a Hugging Face config.json.

Everything downstream reads these frozen dataclasses, never the raw HF dict. Family differences
(qkv bias, q/k norm) are flags resolved here from a registry keyed by architecture name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import StartupError
from tandem.layers.kv_cache import CacheLayout


class ConfigError(StartupError):
    """A config.json that Tandem cannot serve; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default", "linear", "llama3", "yarn" or "proportional"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN only (DeepSeek-V3 / Kimi-K2); the defaults are transformers'. mscale 0 means absent.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin scale; None derives it from factor and the mscales
    truncate: bool = True
    # Proportional only (Gemma 4 full layers): the share of the head whose pairs turn; the other pairs get
    # frequency 0 (rotation by 0), and the exponents still count over the whole head.
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes "rope_parameters" (theta included); older files use
        # "rope_theta" plus an optional "rope_scaling" dict.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in ("default", "linear", "llama3", "yarn", "proportional"):
            raise ConfigError(
                f"rope_scaling.rope_type: {rope_type!r} is not supported (default, linear, llama3, yarn, proportional)"
            )
        if rope_type == "yarn" and "factor" not in params:
            raise ConfigError("rope_scaling.factor: missing for yarn rope scaling")
        attention_factor = params.get("attention_factor")
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
            # transformers reads these with `or`, so a 0 or null in the file also means the default.
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(params.get("truncate", True)),
            partial_rotary_factor=float(
                1.0 if params.get("partial_rotary_factor") is None else params["partial_rotary_factor"]
            ),
        )


@dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes the Llama-family variants; everything else is shared code."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False


def _llama_traits(hf: dict[str, Any]) -> FamilyTraits:
    bias = bool(hf.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias)


def _qwen2_traits(hf: dict[str, Any]) -> FamilyTraits:
    return FamilyTraits(qkv_bias=True, o_bias=False)


def _qwen3_traits(hf: dict[str, Any]) -> FamilyTraits:
    bias = bool(hf.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm=True)


TARGET_FAMILIES = {
    "LlamaForCausalLM": _llama_traits,
    "MistralForCausalLM": _llama_traits,
    "Qwen2ForCausalLM": _qwen2_traits,
    "Qwen3ForCausalLM": _qwen3_traits,
}


@dataclass(frozen=True)
class GroupedQueryConfig:
    """What the grouped-query families (Llama's, Gemma3) read alike: shapes, and what the servers need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @property
    def cache_layout(self) -> CacheLayout:
        return CacheLayout(self.num_kv_heads, self.head_dim, self.head_dim)


@dataclass(frozen=True)
class ModelConfig(GroupedQueryConfig):
    rope: RopeConfig
    traits: FamilyTraits

    @classmethod
    def from_hf(cls, hf: dict[str, Any], traits: FamilyTraits | None = None) -> ModelConfig:
        """Translates a target config; `traits` given means a draft layer config (no family lookup)."""
        architecture = architecture_of(hf)
        if traits is None:
            if architecture not in TARGET_FAMILIES:
                known = ", ".join(sorted(TARGET_FAMILIES))
                raise ConfigError(f"architectures: {architecture!r} is not a supported target ({known})")
            traits = TARGET_FAMILIES[architecture](hf)
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {hf['hidden_act']!r} is not supported (silu)")
        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window: sliding-window attention is not supported for this family")
        window = hf.get("sliding_window")
        if "use_sliding_window" not in hf and window is not None and window < hf.get("max_position_embeddings", 0):
            # Mistral-style configs enable the window by its presence alone (Qwen2 gates it on use_sliding_window).
            raise ConfigError(f"sliding_window: {window} (sliding-window attention) is not supported for this family")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias: MLP biases are not supported for this family")
        hidden_size = require_int(hf, "hidden_size")
        num_heads = require_int(hf, "num_attention_heads")
        return cls(
            architecture=architecture,
            vocab_size=require_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=require_int(hf, "intermediate_size"),
            num_layers=require_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            traits=traits,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids(hf),
            torch_dtype=checkpoint_dtype(hf),
        )


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"config.json: not found in {model_dir}")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"config.json in {model_dir}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config.json in {model_dir}: a JSON {type(config).__name__}, not an object")
    return config


def architecture_of(hf: dict[str, Any]) -> str:
    """config.json's first architecture name, the one that picks the model family."""
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ConfigError("architectures: missing from config.json")
    architecture: str = architectures[0]
    return architecture


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """The dtype the checkpoint's tensors are stored in (transformers >= 5 writes `dtype`, older `torch_dtype`)."""
    return str(hf.get("torch_dtype") or hf.get("dtype") or "float32")


def eos_token_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id, which may be one id, a list of ids or absent."""
    eos = hf.get("eos_token_id")
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def read_target_config(model_dir: Path) -> dict[str, Any]:
    """config.json, with the eos_token_id of generation_config.json (when there is one) added to its own.

    Chat checkpoints often name their end-of-turn token only in generation_config.json, which is what transformers'
    generate stops at; a target that read config.json alone would run past the end of every answer.
    """
    hf = read_hf_config(model_dir)
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return hf
    try:
        generation = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"generation_config.json: not valid JSON ({error})") from None
    eos = generation.get("eos_token_id") if isinstance(generation, dict) else None
    listed = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in listed):
        raise ConfigError(f"generation_config.json: eos_token_id must be a token id or a list of them, got {eos!r}")
    ids = eos_token_ids(hf)
    return {**hf, "eos_token_id": [*ids, *(token for token in dict.fromkeys(listed) if token not in ids)]}


def require_int(hf: dict[str, Any], key: str) -> int:
    if key not in hf:
        raise ConfigError(f"{key}: missing from config.json")
    return int(hf[key])
