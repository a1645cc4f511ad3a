"""EAGLE3 draft head in the SpecForge / SGLang checkpoint format, on the decoder layer of a target family.

One decoder layer with 2*hidden attention input. For each row:
    residual  = fc(aux features)           first step: target features [num_aux * target_hidden]
              = previous draft hidden      later steps (width hidden, fc skipped)
    attention input = concat([input_layernorm(embed(token)), hidden_norm(residual)])   # embedding first
    stream    = layer(residual, attention input)
    logits    = lm_head(norm(stream))      over the draft vocabulary; target id = draft id + d2t[draft id]
    carried   = stream (pre-norm), or norm(stream) when norm_output is set

The embedding is the target's raw table (checkpoints usually omit it; the draft service pulls it from the target).
Gemma targets multiply their embedding by sqrt(hidden) inside the model, but their shared table is the unscaled
one, and the heads trained for them look rows up unscaled: SpecForge copies the target's `model.embed_tokens.weight`
into a plain embedding, and SGLang hands a Gemma target's raw table (cut vocab-parallel) to the head as it is. So
rows are used as stored, unless the head's config sets `scale_embeddings: true` (this project's key), which
multiplies them by sqrt(hidden_size) as Gemma's own embedding does. Since input_layernorm follows, the scale only
moves the result through the norm's eps; with bfloat16 rows it also changes their rounding.

The config's architecture name picks the decoder layer (`EAGLE3_LAYER_KINDS`); the rest of the head is shared:
- LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM: the Llama family's LlamaDecoderLayer, grouped-query attention whose
  cache keeps num_kv_heads keys and values per token;
- Eagle3DeepseekV2ForCausalLM (Kimi-K2.5's kimi-k2.5-eagle3-mla): the DeepSeek-V3 family's DeepseekV3DecoderLayer,
  multi-head latent attention whose cache keeps one kv_lora_rank + qk_rope_head_dim row per token and no values,
  with q_a_proj and kv_a_proj_with_mqa fused into one down projection of the 2*hidden input, and a dense MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ConfigError, FamilyTraits, ModelConfig, read_hf_config
from tandem.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3DraftLayerConfig
from tandem.models.llama import LlamaDecoderLayer
from tandem.models.stack import Embeddings, replaced
from tandem.weights.loader import (
    MLA_A_PROJECTION_PARTS,
    PACKED_PARTS,
    NameMap,
    checkpoint_files,
    iter_tensors,
    load_weights,
    materialized,
    on_meta,
)

# Checkpoint prefixes -> module names; specific renames first (first match wins).
EAGLE3_RENAMES = (
    ("midlayer.hidden_norm.", "hidden_norm."),
    ("layers.0.hidden_norm.", "hidden_norm."),
    ("midlayer.", "layer."),
    ("layers.0.", "layer."),
    ("aux_norm_low.", "fc_norm.0."),
    ("aux_norm_mid.", "fc_norm.1."),
    ("aux_norm_high.", "fc_norm.2."),
)
# Llama layers pack q/k/v and gate/up (the default packing).
EAGLE3_NAME_MAP = NameMap(renames=EAGLE3_RENAMES)
# MLA layers pack gate/up and the q/kv down projections; q_b_proj, kv_b_proj and o_proj load as they are.
EAGLE3_MLA_NAME_MAP = NameMap(
    renames=EAGLE3_RENAMES,
    packed={"gate_proj": PACKED_PARTS["gate_proj"], "up_proj": PACKED_PARTS["up_proj"], **MLA_A_PROJECTION_PARTS},
)


class Eagle3LayerConfig(Protocol):
    """What the head reads of its decoder layer's config (ModelConfig or DeepseekV3DraftLayerConfig)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...  # the TARGET vocabulary
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def cache_layout(self) -> CacheLayout: ...  # what one token leaves in the draft's KV cache


class Eagle3Layer(Protocol):
    """The decoder layer as the head drives it: its input_layernorm normalizes the embedding."""

    input_layernorm: RMSNorm

    def __call__(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] residual stream entering the layer
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        attention_input: torch.Tensor | None = None,  # [num_tokens, 2 * hidden]
    ) -> torch.Tensor: ...  # -> [num_tokens, hidden] residual stream leaving the layer


LayerConfigT = TypeVar("LayerConfigT", bound=Eagle3LayerConfig)


@dataclass(frozen=True)
class Eagle3LayerKind(Generic[LayerConfigT]):
    """One kind of EAGLE3 decoder layer: how to read its config, build it and name its checkpoint tensors."""

    read_config: Callable[[dict[str, Any]], LayerConfigT]  # HF config -> the layer's config
    build: Callable[[LayerConfigT, int], Eagle3Layer]  # (layer config, attention input size) -> layer 0
    name_map: NameMap


def _read_llama_layer(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_hf(hf, traits=FamilyTraits())


def _build_llama_layer(config: ModelConfig, attention_input_size: int) -> LlamaDecoderLayer:
    return LlamaDecoderLayer(config, 0, RotaryEmbedding(config.head_dim, config.rope), attention_input_size)


def _build_mla_layer(config: DeepseekV3DraftLayerConfig, attention_input_size: int) -> DeepseekV3DecoderLayer:
    rotary = RotaryEmbedding(config.attention.qk_rope_head_dim, config.rope, config.rope_interleave)
    return DeepseekV3DecoderLayer(config, 0, rotary, attention_input_size, fused_a_projection=True)


_LLAMA_LAYER = Eagle3LayerKind(_read_llama_layer, _build_llama_layer, EAGLE3_NAME_MAP)
EAGLE3_LAYER_KINDS: dict[str, Eagle3LayerKind[Any]] = {
    "LlamaForCausalLMEagle3": _LLAMA_LAYER,
    "Eagle3LlamaForCausalLM": _LLAMA_LAYER,
    "Eagle3DeepseekV2ForCausalLM": Eagle3LayerKind(
        DeepseekV3DraftLayerConfig.from_hf, _build_mla_layer, EAGLE3_MLA_NAME_MAP
    ),
}


@dataclass(frozen=True)
class Eagle3Config:
    architecture: str  # a key of EAGLE3_LAYER_KINDS
    layer: Eagle3LayerConfig  # the decoder layer's config; layer.vocab_size is the TARGET vocabulary
    target_hidden_size: int
    draft_vocab_size: int
    num_aux: int
    aux_layer_ids: tuple[int, ...] | None
    fc_norm: bool  # one RMSNorm per aux chunk before fc
    norm_before_fc: bool  # one RMSNorm over the whole concatenation before fc
    norm_output: bool  # carry the post-norm hidden to the next step instead of the pre-norm stream
    embedding_scale: float | None  # rows times sqrt(hidden) when the config sets scale_embeddings; None: as stored
    # This project's key: an image's tokens embedded as the "placeholder" token's or the target's "merged" input
    # (draft_server.image_inputs); None: unset
    image_embeddings: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        """The TARGET vocabulary: the embedding's rows and the range of d2t's target ids."""
        return self.layer.vocab_size

    @property
    def cache_layout(self) -> CacheLayout:
        return self.layer.cache_layout

    @property
    def layer_kind(self) -> Eagle3LayerKind[Any]:
        return EAGLE3_LAYER_KINDS[self.architecture]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Eagle3Config:
        architecture = (hf.get("architectures") or ["?"])[0]
        if architecture not in EAGLE3_LAYER_KINDS:
            known = ", ".join(EAGLE3_LAYER_KINDS)
            raise ConfigError(f"architectures: {architecture!r} is not an EAGLE3 head ({known})")
        if int(hf.get("num_hidden_layers", 1)) != 1:
            raise ConfigError(f"num_hidden_layers: EAGLE3 heads have 1 layer, got {hf['num_hidden_layers']}")
        layer = EAGLE3_LAYER_KINDS[architecture].read_config(hf)
        eagle = hf.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
        aux_ids = tuple(int(i) for i in ids) if ids else None
        num_aux = int(hf.get("num_aux_hidden_states") or (len(aux_ids) if aux_ids else 3))
        return cls(
            architecture=architecture,
            layer=layer,
            target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
            draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
            num_aux=num_aux,
            aux_layer_ids=aux_ids,
            fc_norm=bool(hf.get("fc_norm", hf.get("use_aux_norm", False))),
            norm_before_fc=bool(eagle.get("norm_before_fc", hf.get("norm_before_fc", False))),
            norm_output=bool(hf.get("norm_output", False)),
            embedding_scale=layer.hidden_size**0.5 if hf.get("scale_embeddings", False) else None,
            image_embeddings=_image_embeddings(hf.get("image_embeddings")),
        )


def _image_embeddings(value: object) -> str | None:
    if value is not None and value not in ("placeholder", "merged"):
        raise ConfigError(f"image_embeddings: {value!r} is not 'placeholder' or 'merged'")
    return None if value is None else str(value)


@dataclass(frozen=True)
class DraftStep:
    hidden: torch.Tensor  # [num_tokens, hidden] carried to the next step
    logits: torch.Tensor  # [num_tokens, draft_vocab] float32, or [rows, draft_vocab] for the logit_rows asked


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        eps = config.layer.rms_norm_eps
        aux_width = config.num_aux * config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(config.target_hidden_size, eps) for _ in range(config.num_aux))
            if config.fc_norm
            else None
        )
        self.norm_before_fc = RMSNorm(aux_width, eps) if config.norm_before_fc else None
        self.fc = Linear(aux_width, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layer: Eagle3Layer = config.layer_kind.build(config.layer, 2 * hidden)
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_aux * target_hidden] target aux features -> [num_tokens, hidden]."""
        if self.fc_norm is not None:
            chunks = features.split(self.config.target_hidden_size, dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        if self.norm_before_fc is not None:
            features = self.norm_before_fc(features)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] target vocabulary ids
        hidden: torch.Tensor,  # [num_tokens, hidden] projected target features or the previous draft hidden
        metadata: AttentionMetadata,
        cache: PagedKVCache,  # laid out as config.cache_layout
        logit_rows: torch.Tensor | None = None,  # [rows] the rows whose logits are wanted; None: every row
        embeddings: Embeddings | None = None,  # rows embedded as given: the target's at an image's tokens
    ) -> DraftStep:
        embedded = self.layer.input_layernorm(replaced(self.embedded(input_ids), embeddings))
        attention_input = torch.cat([embedded, self.hidden_norm(hidden)], dim=-1)  # [num_tokens, 2 * hidden]
        stream = self.layer(hidden, metadata, cache, attention_input=attention_input)
        normed = self.norm(stream)
        logits = self.lm_head(normed if logit_rows is None else normed[logit_rows]).float()
        return DraftStep(hidden=normed if self.config.norm_output else stream, logits=logits)

    def embedded(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        rows = self.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        if scale is None:
            return rows
        # Rounded to the rows' dtype before the multiply, as Gemma targets round their own scale.
        return rows * torch.tensor(scale, dtype=torch.float32, device=rows.device).to(rows.dtype)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [n] draft ids -> [n] target ids
        d2t: torch.Tensor = self.d2t  # type: ignore[assignment]
        return draft_ids + d2t[draft_ids]


def checkpoint_has(model_dir: Path, name: str) -> bool:
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return True
    return False


def load_eagle3(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[Eagle3Draft, bool]:
    """Loads an EAGLE3 head of any layer kind; returns (model, has_embedding). Without an embedding in the
    checkpoint the caller must fill `embed_tokens` from the target."""
    config = Eagle3Config.from_hf(read_hf_config(model_dir))
    model = materialized(on_meta(lambda: Eagle3Draft(config)), device, dtype)
    # The embedding usually comes from the target; d2t may be absent when the draft vocabulary is the full one.
    full_vocabulary = config.draft_vocab_size == config.vocab_size
    optional = frozenset({"embed_tokens.weight", "d2t"} if full_vocabulary else {"embed_tokens.weight"})
    model.d2t.zero_()  # type: ignore[operator]
    # Poisoned until loaded or filled from the target: a caller that forgets the fill gets NaN logits every time,
    # not whatever the allocator left there.
    model.embed_tokens.weight.data.fill_(float("nan"))
    name_map = config.layer_kind.name_map
    load_weights(model, iter_tensors(model_dir), name_map, source=str(model_dir), optional=optional)
    d2t: torch.Tensor = model.d2t  # type: ignore[assignment]
    target_ids = torch.arange(config.draft_vocab_size, device=d2t.device) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= config.vocab_size:
        raise ConfigError(
            f"d2t: maps draft ids to target ids {int(target_ids.min())}..{int(target_ids.max())}, "
            f"outside the target vocabulary 0..{config.vocab_size - 1}"
        )
    model.eval()
    return model, checkpoint_has(model_dir, "embed_tokens.weight")
