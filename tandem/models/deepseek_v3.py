"""DeepSeek-V3 / Kimi-K2 causal LM (DeepseekV3ForCausalLM) on the paged KV cache, assembled from shared blocks.

What differs from the Llama family:
- attention is multi-head latent attention (tandem.layers.mla) with a compressed cache of one row per token,
  kv_lora_rank + qk_rope_head_dim wide (`cache_layout`), and decoupled rope, usually YaRN-scaled, on the
  qk_rope_head_dim part only; the softmax scale carries YaRN's mscale correction;
- the first `first_k_dense_replace` layers have a dense gated MLP, later ones (every `moe_layer_freq`-th) a mixture
  of routed and shared experts (tandem.layers.moe);
- the checkpoint carries the NextN / MTP draft layers after the last layer (model.layers.{num_hidden_layers + i}):
  the target does not read them (see `skips_layers_after_last` in the registry).
Kimi-K2 checkpoints use this architecture name with model_type "kimi_k2"; the architecture name alone selects this
family, so the alias needs nothing else. Kimi-K2.5 (KimiK25ForConditionalGeneration on the hub,
Kimi_K25ForConditionalGeneration in transformers) is this text model inside a multimodal checkpoint: its
`text_config` and the `language_model.` names (`kimi_k25_text_config`, KIMI_K25_NAMES); its vision tower is not read.
Quantized weights (block-wise fp8, compressed-tensors INT4) stay as stored (tandem.layers.stored).

The EAGLE3 MLA head (Eagle3DeepseekV2ForCausalLM, tandem.models.eagle3) is one layer of this family read from the same
kind of config.json (`DeepseekV3DraftLayerConfig`): the same decoder layer with a 2*hidden attention input, a fused
q/kv down projection and a dense MLP.

EAGLE3 drafts on this target name their layers by the generic rule of tandem.models.aux_layers: with convention
"auto", a first id of 1 means output-of-layer ids (capture index = id + 1), otherwise input-to-layer ids; that is the
rule SGLang applies to DeepSeek-V2/V3 drafts (`ids[0] == 1`). With no ids the default set (2, L // 2, L - 3) is used.

Tensor parallel: MLA's heads (tandem.layers.mla), the dense MLP's units and each routed and shared expert's units
(tandem.layers.moe) are split across ranks, the embedding and head by the vocab-parallel rule; the latent down
projections, the router and the norms are replicated. A tp that does not divide num_attention_heads, intermediate_size
or moe_intermediate_size is refused naming the field, and one that would cut an fp8 block or INT4 group naming both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.mla import MLAConfig, MultiHeadLatentAttention
from tandem.layers.mlp import GatedMLP
from tandem.layers.moe import MixtureOfExperts, MoEConfig
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, yarn_softmax_mscale
from tandem.models.config import (
    ConfigError,
    RopeConfig,
    architecture_of,
    checkpoint_dtype,
    eos_token_ids,
    require_int,
)
from tandem.models.stack import Backbone, CausalLM, DecoderLayer, Embeddings, TargetOutput
from tandem.parallel.group import SINGLE_PROCESS, ParallelGroup
from tandem.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from tandem.weights.loader import PACKED_PARTS, NameMap
from tandem.weights.quantized import QuantizationError, quantization_of

# transformers' DeepseekV3Config defaults, for keys that a config.json leaves out. Shapes have no default: they
# are read with require_int.
HF_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "q_lora_rank": 1536,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,  # DeepSeek's own code; transformers has no such key and behaves as 1
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}

# Only the MLPs' gate/up pairs are packed. MLA's q_proj (q_lora_rank null) is a plain projection here, not the q
# part of a q/k/v pack as in the default map.
CHECKPOINT_NAMES = NameMap(packed={name: PACKED_PARTS[name] for name in ("gate_proj", "up_proj")})

# Kimi-K2.5's language model. The release names it `language_model.model.layers.*` and `language_model.lm_head.*`;
# transformers 5.24 saves `language_model.model.blocks.*` (saving reverts its vision tower's `blocks` -> `layers`
# rename on every name) and loads `model.language_model.*` in memory.
KIMI_K25_NAMES = NameMap(
    renames=(
        ("language_model.model.blocks.", "model.layers."),
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ),
    packed=CHECKPOINT_NAMES.packed,
)
# Kimi-K2.5's vision tower and projector, in the release's names and in transformers' own.
KIMI_K25_TOWERS = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def kimi_k25_text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """Kimi-K2.5's `text_config` as a target config: the top-level architecture, end tokens and tie_word_embeddings.
    The head is tied as transformers' Kimi_K25ForConditionalGeneration ties it: by the top-level flag, true when
    absent (Kimi_K25Config's default); the release sets it false."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"text_config: missing from the config.json of {architecture_of(hf)}")
    ends = list(dict.fromkeys([*eos_token_ids(text), *eos_token_ids(hf)]))
    return text | {
        "architectures": [architecture_of(hf)],
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
        **({"eos_token_id": ends} if ends else {}),
    }


@dataclass(frozen=True)
class DeepseekV3Config:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    num_layers: int
    rms_norm_eps: float
    rope: RopeConfig  # of the qk_rope_head_dim part
    rope_interleave: bool  # the checkpoint's rope dimensions come in adjacent pairs (see tandem.layers.rotary)
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    attention: MLAConfig
    moe: MoEConfig
    first_k_dense_replace: int
    moe_layer_freq: int

    @property
    def cache_layout(self) -> CacheLayout:
        return self.attention.cache_layout

    def is_moe_layer(self, layer_index: int) -> bool:
        """DeepSeek's rule: dense below first_k_dense_replace, then MoE on every moe_layer_freq-th layer."""
        return layer_index >= self.first_k_dense_replace and layer_index % self.moe_layer_freq == 0

    def experts(self, layer_index: int) -> MoEConfig | None:
        """The layer's mixture of experts, or None for a dense MLP."""
        return self.moe if self.is_moe_layer(layer_index) else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV3Config:
        hf = HF_DEFAULTS | hf
        _check_supported(hf)
        hidden_size = require_int(hf, "hidden_size")
        attention, rope = latent_attention_from_hf(hf)
        moe = MoEConfig(
            hidden_size=hidden_size,
            expert_intermediate_size=require_int(hf, "moe_intermediate_size"),
            num_experts=require_int(hf, "n_routed_experts"),
            num_shared_experts=int(hf["n_shared_experts"]),
            experts_per_token=int(hf["num_experts_per_tok"]),
            num_groups=int(hf["n_group"]),
            groups_per_token=int(hf["topk_group"]),
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            normalize_weights=bool(hf["norm_topk_prob"]),
        )
        _check_router(moe)
        return cls(
            architecture=(hf.get("architectures") or ["DeepseekV3ForCausalLM"])[0],
            vocab_size=require_int(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=require_int(hf, "intermediate_size"),
            num_layers=require_int(hf, "num_hidden_layers"),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope=rope,
            rope_interleave=bool(hf["rope_interleave"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            eos_token_ids=eos_token_ids(hf),
            torch_dtype=checkpoint_dtype(hf),
            attention=attention,
            moe=moe,
            first_k_dense_replace=int(hf["first_k_dense_replace"]),
            moe_layer_freq=int(hf["moe_layer_freq"]),
        )


@dataclass(frozen=True)
class DeepseekV3DraftLayerConfig:
    """The one layer of an EAGLE3 MLA head (Eagle3DeepseekV2ForCausalLM, e.g. Kimi-K2.5's), from its DeepSeek-V3
    style config.json: the target's attention and rope translation, and a dense MLP whatever the MoE keys say.

    q_lora_rank must be set: the head's `fused_qkv_a_proj_with_mqa` packs q_a_proj with kv_a_proj_with_mqa. Unlike
    the target, a missing q_lora_rank is refused rather than defaulted, since a guessed rank would only surface as
    a shape error on some tensor.
    """

    vocab_size: int  # the TARGET vocabulary (the embedding's rows)
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig  # of the qk_rope_head_dim part
    rope_interleave: bool
    attention: MLAConfig

    @property
    def cache_layout(self) -> CacheLayout:
        return self.attention.cache_layout

    def experts(self, layer_index: int) -> MoEConfig | None:
        """Always None: EAGLE3 MLA heads have a dense MLP."""
        return None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV3DraftLayerConfig:
        if hf.get("q_lora_rank") is None:
            raise ConfigError(
                "q_lora_rank: missing or null; an EAGLE3 MLA head needs the low-rank query, whose q_a_proj is packed "
                "with kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa"
            )
        hf = HF_DEFAULTS | hf
        _check_weights_and_activation(hf)
        attention, rope = latent_attention_from_hf(hf)
        return cls(
            vocab_size=require_int(hf, "vocab_size"),
            hidden_size=attention.hidden_size,
            intermediate_size=require_int(hf, "intermediate_size"),
            rms_norm_eps=float(hf["rms_norm_eps"]),
            rope=rope,
            rope_interleave=bool(hf["rope_interleave"]),
            attention=attention,
        )


def latent_attention_from_hf(hf: dict[str, Any]) -> tuple[MLAConfig, RopeConfig]:
    """MLA shapes and the rope of their qk_rope_head_dim part, from a config with HF_DEFAULTS applied.

    The softmax scale carries YaRN's mscale correction (tandem.layers.rotary.yarn_softmax_mscale).
    """
    rope = RopeConfig.from_hf(hf)
    qk_nope_head_dim = require_int(hf, "qk_nope_head_dim")
    qk_rope_head_dim = require_int(hf, "qk_rope_head_dim")
    attention = MLAConfig(
        hidden_size=require_int(hf, "hidden_size"),
        num_heads=require_int(hf, "num_attention_heads"),
        q_lora_rank=None if hf["q_lora_rank"] is None else int(hf["q_lora_rank"]),
        kv_lora_rank=require_int(hf, "kv_lora_rank"),
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=require_int(hf, "v_head_dim"),
        attention_bias=bool(hf["attention_bias"]),
        softmax_scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * yarn_softmax_mscale(rope),
    )
    return attention, rope


def _check_supported(hf: dict[str, Any]) -> None:
    _check_weights_and_activation(hf)
    if hf["scoring_func"] != "sigmoid":
        raise ConfigError(f"scoring_func: {hf['scoring_func']!r} is not supported (sigmoid, DeepSeek-V3's router)")
    if hf["topk_method"] != "noaux_tc":
        raise ConfigError(f"topk_method: {hf['topk_method']!r} is not supported (noaux_tc, DeepSeek-V3's router)")
    if int(hf["moe_layer_freq"]) < 1:
        raise ConfigError(f"moe_layer_freq: {hf['moe_layer_freq']} (must be >= 1)")


def _check_weights_and_activation(hf: dict[str, Any]) -> None:
    if hf["hidden_act"] != "silu":
        raise ConfigError(f"hidden_act: {hf['hidden_act']!r} is not supported (silu)")
    try:
        # The loader reads what this accepts; refused here, a quantization is named before any weight is read.
        quantization_of(hf)
    except QuantizationError as error:
        raise ConfigError(str(error)) from None


def _check_router(moe: MoEConfig) -> None:
    if moe.num_groups < 1 or moe.num_experts % moe.num_groups != 0:
        raise ConfigError(f"n_group: {moe.num_groups} does not divide n_routed_experts {moe.num_experts}")
    per_group = moe.num_experts // moe.num_groups
    if per_group < 2:
        raise ConfigError(
            f"n_group: {moe.num_groups} leaves {per_group} expert per group (groups rank by their best 2)"
        )
    if not 1 <= moe.groups_per_token <= moe.num_groups:
        raise ConfigError(f"topk_group: {moe.groups_per_token} (must be in 1..n_group {moe.num_groups})")
    if not 1 <= moe.experts_per_token <= moe.groups_per_token * per_group:
        raise ConfigError(
            f"num_experts_per_tok: {moe.experts_per_token} (must be in 1..{moe.groups_per_token * per_group}, "
            f"the experts of topk_group groups)"
        )
    if moe.num_shared_experts < 1:
        raise ConfigError(f"n_shared_experts: {moe.num_shared_experts} is not supported (DeepSeek-V3 has >= 1)")


class MLALayerConfig(Protocol):
    """What a DeepSeek-V3 decoder layer reads of its config: the target's (DeepseekV3Config) or an EAGLE3 MLA
    head's (DeepseekV3DraftLayerConfig)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...  # the dense MLP's
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def attention(self) -> MLAConfig: ...
    def experts(self, layer_index: int) -> MoEConfig | None: ...


class DeepseekV3DecoderLayer(DecoderLayer):
    """The shared pre-norm layer (tandem.models.stack.DecoderLayer) with MLA and a dense or MoE MLP.
    `attention_input_size` is 2*hidden for EAGLE3 heads, which attend over concat([embedding, hidden]) instead of
    the normed residual stream; they also fuse the q/kv down projections (`fused_a_projection`, see
    MultiHeadLatentAttention)."""

    self_attn: MultiHeadLatentAttention

    def __init__(
        self,
        config: MLALayerConfig,
        layer_index: int,
        rotary: RotaryEmbedding,
        attention_input_size: int | None = None,
        fused_a_projection: bool = False,
        group: ParallelGroup = SINGLE_PROCESS,
    ) -> None:
        attention = MultiHeadLatentAttention(
            layer_index, config.attention, rotary, attention_input_size, fused_a_projection, group
        )
        experts = config.experts(layer_index)
        mlp: MixtureOfExperts | GatedMLP = (
            MixtureOfExperts(experts, group)
            if experts is not None
            else GatedMLP(config.hidden_size, config.intermediate_size, group=group)
        )
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class DeepseekV3Backbone(Backbone):
    def __init__(self, config: DeepseekV3Config, group: ParallelGroup) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(config.attention.qk_rope_head_dim, config.rope, config.rope_interleave)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, index, self.rotary, group=group) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(CausalLM[DeepseekV3Config]):
    """Tensor parallel: heads, MLP units and each expert's units are split across ranks, the vocabulary too; every
    rank caches the whole latent of each token (`cache_layout` is config.cache_layout)."""

    def __init__(self, config: DeepseekV3Config, group: ParallelGroup = SINGLE_PROCESS) -> None:
        head = ParallelLMHead(config.vocab_size, config.hidden_size, group)
        super().__init__(config, group, DeepseekV3Backbone(config, group), head)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        capture: Sequence[int] = (),
        embeddings: Embeddings | None = None,  # Kimi-K2.5's image features at its placeholders
    ) -> TargetOutput:
        """Kimi-K2.5's image tokens attend causally, as its text does."""
        return super().forward(input_ids, metadata.without_spans(), cache, capture, embeddings)

    @property
    def cache_layout(self) -> CacheLayout:
        return self.config.cache_layout
