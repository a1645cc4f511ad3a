"""Gemma3 text causal LM (Gemma3ForCausalLM) on the paged KV cache, assembled from the shared blocks.

What differs from the Llama family, each a flag of a shared block or a line here:
- the embedding is multiplied by sqrt(hidden) inside the model; `model.embed_tokens` holds the raw (unscaled) table,
  which is what a draft sharing the embedding receives;
- every norm is (1 + weight) RMSNorm in float32, and each layer normalises both the input and the output of its
  attention and of its MLP (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  post_feedforward_layernorm); q and k are normalised per head the same way;
- the gated MLP uses tanh-approximated GELU, and attention scores are scaled by query_pre_attn_scalar ** -0.5;
- sliding-window (local) layers are interleaved with global ones; local layers use their own rope base
  (rope_local_base_freq), global layers rope_theta with the optional linear scaling;
- an optional final logit softcap: logits = cap * tanh(logits / cap).

Tensor parallel (`group`): attention heads and MLP units are split across ranks as in the Llama family, but the
embedding and the (usually tied) LM head stay replicated, the plain replicated embedding that REFERENCE.md describes
for Gemma3: every rank holds the whole raw table and computes the whole logits, so the sqrt(hidden) scale and the
softcap need no communication. A draft that shares the table gets it cut by the vocab-parallel rule
(TargetRunner.weight_shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.matmul import Linear
from tandem.layers.mlp import ACTIVATIONS, GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import (
    ConfigError,
    GroupedQueryConfig,
    RopeConfig,
    architecture_of,
    checkpoint_dtype,
    eos_token_ids,
    require_int,
)
from tandem.models.stack import Backbone, CausalLM, DecoderLayer
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.weights.loader import NameMap

# transformers' Gemma3TextConfig defaults, for keys that a config.json leaves out (the text_config of the multimodal
# releases leaves out most of them).
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,  # older files: every 6th layer is global
    "rope_theta": 1_000_000.0,  # global layers
    "rope_local_base_freq": 10_000.0,  # sliding-window layers
    "eos_token_id": 1,
}
SLIDING, GLOBAL = "sliding_attention", "full_attention"  # transformers' layer type names

# Multimodal checkpoints served as text targets (Gemma3ForConditionalGeneration, Gemma4ForConditionalGeneration):
# their language model's tensors, under the prefix each ships (the Gemma 3 hub files and transformers' save of
# either: language_model.model.*; Gemma 4 and Gemma 3 saved from transformers' in-memory layout:
# model.language_model.*), map onto the text model's names; the vision and audio towers and their projectors are
# not read.
MULTIMODAL_NAMES = NameMap(
    renames=(
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    )
)
MULTIMODAL_TOWERS = (
    "vision_tower.",  # Gemma 3, as shipped and as transformers saves it
    "multi_modal_projector.",
    "model.vision_tower.",  # Gemma 4; Gemma 3 in transformers' in-memory layout
    "model.multi_modal_projector.",
    "model.embed_vision.",  # Gemma 4's projections of the towers' outputs, and its audio tower
    "model.embed_audio.",
    "model.audio_tower.",
)


def language_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's `text_config` as a text target's config: its architecture, its end tokens together with
    the top-level ones (generation_config.json's among them, tandem.models.config.read_target_config), and the
    top-level tie_word_embeddings, which is what ties transformers' multimodal head."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: missing from the config.json of {architecture_of(hf)}")
    language_model: dict[str, Any] = {**text, "architectures": [architecture_of(hf)]}
    ends = list(dict.fromkeys([*eos_token_ids(text), *eos_token_ids(hf)]))
    if ends:
        language_model["eos_token_id"] = ends
    if "tie_word_embeddings" in hf:
        language_model["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return language_model


def multimodal_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration's language model as transformers 5.24 runs it: like language_model_config,
    but with no final logit softcap, which its head does not apply (the text model's Gemma3ForCausalLM does). The
    Gemma 3 releases set none; a cap would not change a greedy choice either, only the probabilities."""
    return language_model_config(hf) | {"final_logit_softcapping": None}


@dataclass(frozen=True)
class Gemma3Config(GroupedQueryConfig):
    hidden_activation: str
    attention_bias: bool
    query_pre_attn_scalar: float
    sliding_window: int | None  # a local layer's query sees this many positions, itself included
    sliding_layers: tuple[bool, ...]  # per layer: True = sliding-window (local), False = global
    global_rope: RopeConfig
    local_rope: RopeConfig
    final_logit_softcapping: float | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma3Config:
        hf = HF_DEFAULTS | hf
        if hf.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                f"attn_logit_softcapping: {hf['attn_logit_softcapping']} (attention logit softcapping) is not supported"
            )
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention: bidirectional attention is not supported (causal only)")
        if hf["hidden_activation"] not in ACTIVATIONS:
            known = ", ".join(ACTIVATIONS)
            raise ConfigError(f"hidden_activation: {hf['hidden_activation']!r} is not supported ({known})")
        num_layers = require_int(hf, "num_hidden_layers")
        sliding_layers = _sliding_layers(hf, num_layers)
        window = hf["sliding_window"]
        if any(sliding_layers) and (window is None or int(window) < 1):
            raise ConfigError(f"sliding_window: {window}, but some layers are sliding-window layers (needs >= 1)")
        global_rope, local_rope = _ropes(hf)
        softcap = hf.get("final_logit_softcapping")
        return cls(
            **gemma_fields(hf, num_layers),
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
            sliding_window=None if window is None else int(window),
            sliding_layers=sliding_layers,
            global_rope=global_rope,
            local_rope=local_rope,
            final_logit_softcapping=None if softcap is None else float(softcap),
        )


def gemma_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The config fields Gemma 3 and Gemma 4 read alike, from a config with its defaults merged."""
    num_heads = require_int(hf, "num_attention_heads")
    return {
        "architecture": architecture_of(hf),
        "vocab_size": require_int(hf, "vocab_size"),
        "hidden_size": require_int(hf, "hidden_size"),
        "intermediate_size": require_int(hf, "intermediate_size"),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
        "head_dim": int(hf["head_dim"]),
        "rms_norm_eps": float(hf["rms_norm_eps"]),
        "max_position_embeddings": int(hf["max_position_embeddings"]),
        "tie_word_embeddings": bool(hf["tie_word_embeddings"]),
        "eos_token_ids": eos_token_ids(hf),
        "torch_dtype": checkpoint_dtype(hf),
        "hidden_activation": str(hf["hidden_activation"]),
        "attention_bias": bool(hf["attention_bias"]),
    }


def _sliding_layers(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """transformers >= 4.53 writes layer_types; older files give sliding_window_pattern (every n-th layer global)."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf["sliding_window_pattern"])
        return tuple((index + 1) % pattern != 0 for index in range(num_layers))
    unknown = sorted(set(layer_types) - {SLIDING, GLOBAL})
    if unknown:
        raise ConfigError(f"layer_types: {unknown} are not supported ({SLIDING}, {GLOBAL})")
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types: {len(layer_types)} entries for num_hidden_layers {num_layers}")
    return tuple(layer_type == SLIDING for layer_type in layer_types)


def _ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(global, local) rope. transformers >= 5 writes one rope_parameters dict per layer type; older files give
    rope_theta and rope_scaling (global layers only) and rope_local_base_freq."""
    per_type = hf.get("rope_parameters")
    if per_type is None:
        global_rope = RopeConfig.from_hf({"rope_theta": hf["rope_theta"], "rope_scaling": hf.get("rope_scaling")})
        return global_rope, RopeConfig(theta=float(hf["rope_local_base_freq"]))
    if not {SLIDING, GLOBAL} <= per_type.keys():
        raise ConfigError(f"rope_parameters: expected one entry per layer type ({SLIDING}, {GLOBAL}), got {per_type}")
    # A per-type dict without rope_theta falls back to the same defaults as the older keys.
    return (
        RopeConfig.from_hf({"rope_theta": hf["rope_theta"], "rope_parameters": per_type[GLOBAL]}),
        RopeConfig.from_hf({"rope_theta": hf["rope_local_base_freq"], "rope_parameters": per_type[SLIDING]}),
    )


def default_capture_indices(num_layers: int) -> tuple[int, ...]:
    """EAGLE3 capture indices when a draft names no layers: SGLang's Gemma3 set, inputs of layers 2, L // 2, L - 2."""
    return (2, num_layers // 2, num_layers - 2)


class Gemma3DecoderLayer(DecoderLayer):
    """The shared layer (tandem.models.stack.DecoderLayer) with sandwich (1 + weight) norms, q/k-normed grouped-query
    attention, sliding-window on local layers, and a tanh-GELU gated MLP."""

    def __init__(self, config: Gemma3Config, layer_index: int, rotary: RotaryEmbedding, group: ParallelGroup) -> None:
        hidden, eps = config.hidden_size, config.rms_norm_eps
        attention = Attention(
            layer_index=layer_index,
            input_size=hidden,
            output_size=hidden,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm_eps=eps,
            qk_norm_unit_offset=True,
            scaling=config.query_pre_attn_scalar**-0.5,
            sliding_window=config.sliding_window if config.sliding_layers[layer_index] else None,
            group=group,
        )
        mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation, group)
        super().__init__(attention, mlp, hidden, eps, unit_offset=True, sandwich_norms=True)


class Gemma3Backbone(Backbone):
    def __init__(self, config: Gemma3Config, group: ParallelGroup) -> None:
        super().__init__()
        self.global_rotary = RotaryEmbedding(config.head_dim, config.global_rope)
        self.local_rotary = RotaryEmbedding(config.head_dim, config.local_rope)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)  # unscaled, as in the checkpoint
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, index, self.local_rotary if sliding else self.global_rotary, group)
            for index, sliding in enumerate(config.sliding_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)


class Gemma3ForCausalLM(CausalLM[Gemma3Config]):
    def __init__(self, config: Gemma3Config, group: ParallelGroup = SINGLE_PROCESS) -> None:
        super().__init__(
            config,
            group,
            Gemma3Backbone(config, group),
            Linear(config.hidden_size, config.vocab_size, bias=False),
            embedding_scale=config.hidden_size**0.5,
            logit_softcap=config.final_logit_softcapping,
        )
