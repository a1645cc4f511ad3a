"""MTP draft heads: DeepSeek-V3 NextN, and chained multi-layer MTP (Step-3.5's own, and on Llama-family targets).

One MTP layer (every kind), for a row at position p:
    fused  = eh_proj(concat([enorm(embed(token)), hnorm(hidden)]))   embedding FIRST; Linear 2H -> H, no bias
    stream = decoder layer of the target family (fused)             its own KV cache; the PRE-norm output
    logits = head(shared_head.norm(stream))
`embed` is the target's table and `head` the target's LM head (see "Shared tables" below), except for a Step-3.5
layer that ships its own `shared_head.output`.

Two ways of drafting with MTP layers, chosen by the target family through `MTP_FAMILIES` (never by name checks):
- "nextn" (DeepSeek-V3, Kimi-K2): one NextN layer fed the target's POST-final-norm hidden state (target capture
  index num_layers + 1), reused at every draft step exactly like an EAGLE3 head: `NextNDraft` runs on the draft
  service's DraftRunner. What a step hands to the next one is an explicit choice (`NextNFeedback`): "post_norm",
  the layer's shared_head.norm output (SGLang), or "pre_norm", its stream (vLLM).
- "chained" (Step-3.5 / Step-3.7, and Llama, Qwen2, Qwen3, Mistral): N layers, layer k producing draft step k + 1,
  layer k fed layer k - 1's output (or the target's hidden again, non-chain mode). Which hidden flows is the
  `HiddenFlow`: "pre_norm" (SGLang's step3p5_mtp, the authors' serving code: layer 0 reads the target's final
  stream before its norm, capture index num_layers, and each layer hands on its stream) or "post_norm"
  (transformers' MtpModel, `generate(use_mtp=True)`: the target's post-final-norm hidden, num_layers + 1, and each
  layer's shared_head.norm output). Served by draft_server.mtp_runner.MTPRunner (position alignment there).

Checkpoint format (both kinds): a directory whose config.json is the TARGET's config.json plus
`num_nextn_predict_layers: N`, holding MTP layer i as `model.layers.{num_hidden_layers + i}.*`:
    enorm.weight, hnorm.weight, eh_proj.weight [H, 2H], shared_head.norm.weight,
    the target family's decoder layer: input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
(Step-3.5 adds `shared_head.output` on some layers and keeps some blocks under `.transformer.`.) That is how
DeepSeek-V3 (layer 61) and Step-3.5 (layers 45-47; config under `text_config` for Step-3.7) ship them, and the
format of the project's chained MTP demo. Nothing else is read but the target-level shared tables when present:
the target's own layers are skipped unread, and the per-layer copies DeepSeek stores
(`model.layers.{L+i}.embed_tokens`, `model.layers.{L+i}.shared_head.head`) are neither required nor read.

Shared tables: `load_mtp` loads `model.embed_tokens.weight` and `lm_head.weight` when the directory has them (a full
target checkpoint does) and reports the others in `LoadedMTP.missing_shared`, named as the target's GetWeights names
them ("embed_tokens", "lm_head"); the caller fills each with `MTPModel.fill_shared`. Running with a table unfilled
is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import TARGET_FAMILIES, ConfigError, ModelConfig, architecture_of, read_hf_config
from tandem.models.deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer
from tandem.models.eagle3 import DraftStep, checkpoint_has
from tandem.models.llama import LlamaDecoderLayer
from tandem.models.registry import keep_float32, target_architecture
from tandem.models.stack import Embeddings, replaced
from tandem.models.step3p5_mtp import Step3p5MTPConfig, Step3p5Rotaries, step3p5_mtp_block
from tandem.weights.loader import CheckpointError, NameMap, iter_tensors, load_weights, materialized, on_meta

MTPStyle = Literal["nextn", "chained"]
HiddenFlow = Literal["post_norm", "pre_norm"]
SharedTable = Literal["embed_tokens", "lm_head"]

# Modules of an MTP layer that are its own; every other name under model.layers.{L+i}. is its decoder layer's.
MTP_OWN_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.", "shared_head.output.")
# Where some releases keep the decoder layer's weights inside an MTP layer (Step-3.5: model.layers.{L+i}.transformer.).
BLOCK_PREFIXES = ("transformer.",)
# Per-layer copies of the shared tables (DeepSeek-V3 stores them): never read, the target's tables are used.
SHARED_TABLE_COPIES = ("embed_tokens.", "shared_head.head.")
# Target-level shared tables: GetWeights name (also our module name) -> checkpoint module prefix.
SHARED_TABLES: dict[SharedTable, str] = {"embed_tokens": "model.embed_tokens.", "lm_head": "lm_head."}


class MTPTargetConfig(Protocol):
    """What the MTP layers need of the target family's config (ModelConfig, DeepseekV3Config, Step3p5MTPConfig)."""

    @property
    def architecture(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def cache_layout(self) -> CacheLayout: ...


FamilyConfig = TypeVar("FamilyConfig", bound=MTPTargetConfig)
Rotary = TypeVar("Rotary", bound=nn.Module)


@dataclass(frozen=True)
class MTPFamily(Generic[FamilyConfig, Rotary]):
    parse_config: Callable[[dict[str, Any]], FamilyConfig]  # the target's HF config -> the family's config
    build_rotary: Callable[[FamilyConfig], Rotary]
    # (config, checkpoint layer index num_layers + i, rotary) -> the decoder layer; its attention must use cache
    # layer 0, because every MTP layer keeps its own KV sequences in a one-layer pool.
    build_layer: Callable[[FamilyConfig, int, Rotary], nn.Module]
    style: MTPStyle
    default_flow: HiddenFlow  # what the family's authors' serving code hands on (SGLang)
    norm_unit_offset: bool = False  # enorm, hnorm, shared_head.norm are (1 + w) norms (Step-3.5)
    own_heads: bool = False  # a layer may ship its own LM head, shared_head.output (Step-3.5)


def _llama_rotary(config: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(config.head_dim, config.rope)


def _llama_layer(config: ModelConfig, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
    return LlamaDecoderLayer(config, 0, rotary)  # a Llama layer's index only picks its cache layer


def _deepseek_rotary(config: DeepseekV3Config) -> RotaryEmbedding:
    return RotaryEmbedding(config.attention.qk_rope_head_dim, config.rope, config.rope_interleave)


def _deepseek_layer(config: DeepseekV3Config, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
    # The checkpoint index decides dense MLP or MoE (DeepSeek-V3's layer 61 is MoE); the cache layer is 0.
    layer = DeepseekV3DecoderLayer(config, layer_index, rotary)
    layer.self_attn.layer_index = 0
    return layer


_CHAINED_LLAMA = MTPFamily(ModelConfig.from_hf, _llama_rotary, _llama_layer, "chained", "pre_norm")
_STEP3P5 = MTPFamily(
    Step3p5MTPConfig.from_hf,
    Step3p5Rotaries,
    step3p5_mtp_block,
    "chained",
    "pre_norm",
    norm_unit_offset=True,
    own_heads=True,
)
MTP_FAMILIES: dict[str, MTPFamily[Any, Any]] = {
    **dict.fromkeys(TARGET_FAMILIES, _CHAINED_LLAMA),
    "DeepseekV3ForCausalLM": MTPFamily(
        DeepseekV3Config.from_hf, _deepseek_rotary, _deepseek_layer, "nextn", "post_norm"
    ),
    "Step3p5ForCausalLM": _STEP3P5,
    "Step3p7ForConditionalGeneration": _STEP3P5,
}


def declared_mtp_layers(hf: dict[str, Any]) -> int:
    """num_nextn_predict_layers, at the top level or in `text_config` (Step-3.7); 0 when absent."""
    return int(hf.get("num_nextn_predict_layers") or (hf.get("text_config") or {}).get("num_nextn_predict_layers") or 0)


def mtp_family(architecture: str) -> MTPFamily[Any, Any]:
    if architecture not in MTP_FAMILIES:
        known = ", ".join(sorted(MTP_FAMILIES))
        raise ConfigError(f"architectures: {architecture!r} has no MTP draft support ({known})")
    return MTP_FAMILIES[architecture]


@dataclass(frozen=True)
class MTPConfig:
    target: MTPTargetConfig  # the target's config; the MTP layers' decoder layers have its shapes
    num_mtp_layers: int  # num_nextn_predict_layers
    family: MTPFamily[Any, Any]
    own_heads: tuple[bool, ...] = ()  # per layer: it has its own shared_head.output (read from the checkpoint)

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def num_target_layers(self) -> int:
        return self.target.num_layers

    @property
    def style(self) -> MTPStyle:
        return self.family.style

    @property
    def cache_layout(self) -> CacheLayout:
        return self.target.cache_layout

    @property
    def capture_index(self) -> int:
        """capture_index_for the family's default flow."""
        return self.capture_index_for(self.family.default_flow)

    def capture_index_for(self, flow: HiddenFlow) -> int:
        """The one target capture index the draft subscribes to: num_layers + 1 (the target's post-final-norm hidden)
        for NextN and for chained MTP with the post_norm flow, num_layers (the final stream before the norm) for
        chained MTP with the pre_norm flow."""
        post_norm = self.style == "nextn" or flow == "post_norm"
        return self.num_target_layers + (1 if post_norm else 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MTPConfig:
        family = mtp_family(architecture_of(hf))
        num_mtp_layers = declared_mtp_layers(hf)
        if num_mtp_layers < 1:
            raise ConfigError(f"num_nextn_predict_layers: {num_mtp_layers}; an MTP draft checkpoint needs >= 1")
        return cls(target=family.parse_config(hf), num_mtp_layers=num_mtp_layers, family=family)


@dataclass(frozen=True)
class MTPLayerOutput:
    stream: torch.Tensor  # [num_tokens, hidden] pre-norm output (what chained MTP hands to the next layer)
    normed: torch.Tensor  # [num_tokens, hidden] shared_head.norm(stream), the LM-head input


class SharedHead(nn.Module):
    """The norm of `shared_head`; DeepSeek's `head` is the target's LM head, shared, while a Step-3.5 layer may have
    its own `output` head."""

    def __init__(self, config: MTPConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.target.rms_norm_eps, config.family.norm_unit_offset)
        self.output = Linear(config.hidden_size, config.vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    def __init__(self, config: MTPConfig, index: int, rotary: nn.Module) -> None:
        super().__init__()
        hidden, eps, offset = config.hidden_size, config.target.rms_norm_eps, config.family.norm_unit_offset
        self.enorm = RMSNorm(hidden, eps, offset)
        self.hnorm = RMSNorm(hidden, eps, offset)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.decoder = config.family.build_layer(config.target, config.num_target_layers + index, rotary)
        self.shared_head = SharedHead(config, index < len(config.own_heads) and config.own_heads[index])

    def forward(
        self,
        embedded: torch.Tensor,  # [num_tokens, hidden] raw embeddings of the tokens
        hidden: torch.Tensor,  # [num_tokens, hidden] target hidden or the previous MTP layer's output
        metadata: AttentionMetadata,
        cache: PagedKVCache,
    ) -> MTPLayerOutput:
        fused = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        stream = self.decoder(fused, metadata, cache)
        return MTPLayerOutput(stream=stream, normed=self.shared_head.norm(stream))


class MTPModel(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = config.family.build_rotary(config.target)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MTPLayer(config, index, self.rotary) for index in range(config.num_mtp_layers))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_shared()
        # Shared tables the loader could not fill; running with one is refused rather than drafting from garbage.
        self.unfilled_shared: set[SharedTable] = set()

    def tie_shared(self) -> None:
        if self.config.target.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def fill_shared(self, name: SharedTable, weight: torch.Tensor) -> None:  # weight: [vocab, hidden]
        """Copies a table pulled from the target (GetWeights name) into place; a tied head fills both."""
        table = self.embed_tokens.weight if name == "embed_tokens" else self.lm_head.weight
        if table.shape != weight.shape:
            raise CheckpointError(
                f"{name}: the target's table has shape {tuple(weight.shape)}, the MTP draft needs {tuple(table.shape)}"
            )
        with torch.no_grad():
            table.copy_(weight)
        self.unfilled_shared.discard(name)
        if self.config.target.tie_word_embeddings:
            self.unfilled_shared.clear()

    def run_layer(
        self,
        index: int,
        input_ids: torch.Tensor,  # [num_tokens] target vocabulary ids
        hidden: torch.Tensor,  # [num_tokens, hidden]
        metadata: AttentionMetadata,
        cache: PagedKVCache,  # one layer, laid out as config.cache_layout; each MTP layer has its own sequences
        embeddings: Embeddings | None = None,  # rows embedded as given: the target's at an image's tokens
    ) -> MTPLayerOutput:
        if self.unfilled_shared:
            raise RuntimeError(f"MTP draft: shared tables {sorted(self.unfilled_shared)} not filled from the target")
        embedded = replaced(self.embed_tokens(input_ids), embeddings)
        output: MTPLayerOutput = self.layers[index](embedded, hidden, metadata, cache)
        return output

    def compute_logits(self, normed: torch.Tensor, layer: int = 0) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        """The layer's own head (shared_head.output) when it has one, else the target's."""
        module = self.layers[layer]
        assert isinstance(module, MTPLayer)
        own = module.shared_head.output
        return (self.lm_head if own is None else own)(normed).float()


class NextNDraft(nn.Module):
    """A one-layer MTP model with the draft-model interface of draft_server.runner.DraftRunner: the layer is reused
    at every step, each step fed the previous step's hidden (`feedback`) and draft token."""

    def __init__(self, mtp: MTPModel, feedback: HiddenFlow) -> None:
        super().__init__()
        if mtp.config.num_mtp_layers != 1:
            raise ConfigError(
                f"num_nextn_predict_layers: {mtp.config.num_mtp_layers}; a NextN draft reuses exactly one layer"
            )
        self.mtp = mtp
        self.config = mtp.config
        self.feedback = feedback

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.mtp.embed_tokens

    def project_features(self, features: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """The target's post-norm hidden state already has the layer's width: nothing to project."""
        return features

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] target vocabulary ids
        hidden: torch.Tensor,  # [num_tokens, hidden] target post-norm hidden, or the previous step's feedback
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        logit_rows: torch.Tensor | None = None,  # [rows] the rows whose logits are wanted; None: every row
        embeddings: Embeddings | None = None,  # rows embedded as given: the target's at an image's tokens
    ) -> DraftStep:
        output = self.mtp.run_layer(0, input_ids, hidden, metadata, cache, embeddings)
        carried = output.normed if self.feedback == "post_norm" else output.stream
        normed = output.normed if logit_rows is None else output.normed[logit_rows]
        return DraftStep(hidden=carried, logits=self.mtp.compute_logits(normed))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n]; the vocabulary is the target's
        return draft_ids


def mtp_name_map(config: MTPConfig) -> NameMap:
    """model.layers.{L+i}.enorm.weight -> layers.{i}.enorm.weight; model.layers.{L+i}.self_attn.* ->
    layers.{i}.decoder.self_attn.* (then the family's q/k/v, gate/up packing); model.embed_tokens.weight ->
    embed_tokens.weight."""
    renames: list[tuple[str, str]] = []
    for index in range(config.num_mtp_layers):
        source, target = f"model.layers.{config.num_target_layers + index}.", f"layers.{index}."
        renames.extend((source + own, target + own) for own in MTP_OWN_MODULES)
        renames.extend((source + block, target + "decoder.") for block in BLOCK_PREFIXES)
        renames.append((source, target + "decoder."))
    renames.extend((source, name + ".") for name, source in SHARED_TABLES.items())
    packed = target_architecture(config.target.architecture).name_map.packed
    return NameMap(renames=tuple(renames), packed=dict(packed))


def skips_tensor(config: MTPConfig, name: str) -> bool:
    """True for tensors load_mtp does not even read: the target's own layers and norm, and the per-layer copies of
    the shared tables. Read: model.layers.{L+i}.* of the MTP layers, model.embed_tokens.weight, lm_head.weight."""
    if name.startswith(tuple(SHARED_TABLES.values())):
        return False
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return True
    index = int(parts[2]) - config.num_target_layers
    return not 0 <= index < config.num_mtp_layers or parts[3].startswith(SHARED_TABLE_COPIES)


@dataclass(frozen=True)
class LoadedMTP:
    model: MTPModel
    missing_shared: tuple[SharedTable, ...]  # not in the checkpoint: fill each with model.fill_shared from the target


def load_mtp(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedMTP:
    """Builds only the MTP layers of a target-format checkpoint (module docstring) and loads them."""
    config = MTPConfig.from_hf(read_hf_config(model_dir))
    if config.family.own_heads:
        owned = (
            f"model.layers.{config.num_target_layers + i}.shared_head.output.weight"
            for i in range(config.num_mtp_layers)
        )
        config = replace(config, own_heads=tuple(checkpoint_has(model_dir, name) for name in owned))
    model = materialized(on_meta(lambda: MTPModel(config)), device, dtype)
    keep_float32(model, target_architecture(config.target.architecture).float32_buffers)
    model.tie_shared()
    skip = partial(skips_tensor, config)
    optional = frozenset({"embed_tokens.weight", "lm_head.weight"})
    load_weights(model, iter_tensors(model_dir, skip), mtp_name_map(config), source=str(model_dir), optional=optional)
    # A tied head is the embedding: one table to load or fill.
    tables: tuple[SharedTable, ...] = ("embed_tokens",) if config.target.tie_word_embeddings else tuple(SHARED_TABLES)
    missing = tuple(name for name in tables if not checkpoint_has(model_dir, SHARED_TABLES[name] + "weight"))
    model.unfilled_shared = set(missing)
    model.eval()
    return LoadedMTP(model=model, missing_shared=missing)
