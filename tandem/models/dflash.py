"""Block drafters: DFlash (z-lab's checkpoint layout, arXiv 2602.06036) and DSpark (DeepSpec's), a whole block of
drafts from one forward; DFlash2 extends DFlash's layers and choice of drafts here (tandem.models.dflash2).

The draft has Qwen3-style decoder layers (per-head q/k norms, rotary, SwiGLU), `fc` and `hidden_norm` over the
target's features, a final `norm`, and no embedding or LM head of its own: it uses the target's (pulled from the
target at start-up, `embed_tokens` and `lm_head`). Per request and round:

    context  = hidden_norm(fc(features))   one row per newly verified position p: the outputs of the target layers
                                           named by `target_layer_ids`, concatenated (the first round: the prompt's)
    block    = embed([anchor, MASK x (B - 1)])   the anchor is the token the target produced last, at position P + 1
                                                 when the context ends at P; the block sits at P + 1 .. P + B
    every layer:  K/V of the context rows = k/v_proj(context) (no input norm), kept in the draft's paged cache;
                  Q/K/V of the block rows = q/k/v_proj(input_layernorm(block)); k_norm and rotary on both;
                  the block attends, non-causally, over the cached context, the new context and the whole block
                  (a "sliding_attention" layer of `layer_types` sees keys > position - sliding_window when the config
                  sets use_sliding_window, as transformers' Qwen3Config reads it)
    drafts   = argmax lm_head(norm(block))[1:]    B - 1 drafts, for positions P + 2 .. P + B

The embedding rows are the target's table as stored times the config's `input_embedding_scale` (1 when absent; a
Gemma target's drafter names the scale its target applies inside), and the logits are the LM head's times
`output_multiplier`, softcapped by `final_logit_softcapping` where set (z-lab's newer fields).

The block's K/V is dropped after the forward (the runner cuts the cache back to the context); the next round adds
the context rows of the positions verified since. Example, B = 4, prompt x0..x4, first token x5: the context is the
features of positions 0..4, the block [x5, M, M, M] at positions 5..8, and its rows 1..3 draft x6, x7, x8.

DSpark (`Qwen3DSparkModel`; its fields at the top level of a copy of the target's config, and its own copy of the
target's embedding and LM head where the checkpoint ships them) runs the same backbone, but every block row drafts:
row j drafts position P + 2 + j (B drafts), its logits corrected by a low-rank Markov head from the token before it
(the anchor for row 0, then the drafts, left to right), and a confidence head scores each draft.

Feature ids: `target_layer_ids` name 0-based target layers whose OUTPUT is a feature (transformers'
`hidden_states[id + 1]`): capture index id + 1, the stream entering the next layer; for the last layer, whose
output transformers reports after the final norm, index num_layers + 1 (the final norm's output); DSpark's -1 is
the embedding's output, index 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.layers.attention import Attention
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.block_format import (
    BLOCK_ARCHITECTURES,
    DFLASH2_ARCHITECTURES,
    DFLASH_ARCHITECTURES,
    DSPARK_ARCHITECTURES,
    architecture_name,
    block_fields,
    block_size_of,
    draft_value,
)
from tandem.models.config import ConfigError, FamilyTraits, ModelConfig, read_hf_config
from tandem.models.eagle3 import checkpoint_has
from tandem.weights.loader import NameMap, iter_tensors, load_weights, materialized, on_meta

SHARED_TABLES = ("embed_tokens", "lm_head")  # what the draft takes from the target when its checkpoint lacks them
MARKOV_HEADS = ("vanilla", "gated")
# q/k/v and gate/up pack as in every layer; the gated Markov head's `gate_proj` is no MLP's gate part.
BLOCK_NAME_MAP = NameMap(renames=(("markov_head.gate_proj.", "markov_head.gate."),))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The ids a DFlash config without `target_layer_ids` was trained on: the middle layer for a one-layer draft,
    else evenly from layer 1 to layer L - 3 (Qwen3-8B, 36 layers, 5 draft layers: 1, 9, 17, 25, 33)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def feature_capture(layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The target capture indices of feature ids (module docstring) on a target of `num_layers` layers; DSpark's id
    -1 names the embedding's output, capture index 0."""
    return tuple(num_layers + 1 if i == num_layers - 1 else i + 1 for i in layer_ids)


@dataclass(frozen=True)
class DSparkHeads:
    """DSpark's heads after the backbone: the low-rank Markov head and the confidence head."""

    markov_rank: int  # 0: no Markov head
    markov_type: str  # one of MARKOV_HEADS
    confidence: bool  # a confidence head
    confidence_with_markov: bool  # it reads [hidden ; W1[previous token]], else the hidden alone

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DSparkHeads:
        rank = int(hf.get("markov_rank") or 0)
        kind = str(hf.get("markov_head_type") or "vanilla")
        if rank > 0 and kind not in MARKOV_HEADS:
            raise ConfigError(f"markov_head_type: {kind!r} is not served ({', '.join(MARKOV_HEADS)})")
        confidence = bool(hf.get("enable_confidence_head", False))
        with_markov = confidence and bool(hf.get("confidence_head_with_markov", False))
        if with_markov and rank == 0:
            raise ConfigError("confidence_head_with_markov: true, but markov_rank is 0 (no Markov head to read)")
        return cls(rank, kind, confidence, with_markov)


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # the decoder layers' shapes; hidden_size is the target's, vocab_size the target's
    block_size: int  # B: the anchor and B - 1 mask tokens, giving B - 1 drafts
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # as the config says; None when absent
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    architecture: str = DFLASH_ARCHITECTURES[0]
    dspark: DSparkHeads | None = None  # DSpark's heads; None: a DFlash draft
    # The block's rows are the target's embedding rows as stored times this (`input_embedding_scale`: a Gemma
    # target's drafter names the scale its model applies inside, sqrt(hidden)).
    embedding_scale: float = 1.0
    # The draft logits are the target's LM head times `output_multiplier`, then softcapped where the config sets
    # `final_logit_softcapping` (tanh(logits / cap) * cap).
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @property
    def first_draft_row(self) -> int:
        """The block row whose output is the first draft: 1 for DFlash (row j drafts position P + 1 + j), 0 for
        DSpark (row j drafts the token after it, so the anchor's row drafts too)."""
        return 0 if self.dspark is not None else 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_draft_row

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def cache_layout(self) -> CacheLayout:
        return self.layer.cache_layout

    def capture_indices(self, num_layers: int) -> tuple[int, ...]:
        return feature_capture(self.target_layer_ids, num_layers)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DFlashConfig:
        """DFlash keeps its fields in `dflash_config` (block_size may sit at the top level); DSpark (DeepSpec) keeps
        them at the top level of a copy of the target's config."""
        architecture = architecture_name(hf)
        if architecture not in BLOCK_ARCHITECTURES:
            raise ConfigError(
                f"architectures: {architecture!r} is not a block drafter ({', '.join(BLOCK_ARCHITECTURES)})"
            )
        dspark = architecture in DSPARK_ARCHITECTURES
        dflash = block_fields(hf)
        # Sliding windows are per layer here (layer_types), which ModelConfig refuses for a whole model.
        plain = {key: value for key, value in hf.items() if key not in ("use_sliding_window", "sliding_window")}
        bias = bool(hf.get("attention_bias", False))
        layer = ModelConfig.from_hf(plain, traits=FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm=True))
        block_size = block_size_of(hf)
        if block_size is None or int(block_size) < 2:
            raise ConfigError(f"block_size: {block_size!r}; a block drafter needs a block of at least 2 tokens")
        if dflash.get("mask_token_id") is None:
            raise ConfigError(
                f"{'' if dspark else 'dflash_config.'}mask_token_id: missing; the block is filled with it"
            )
        num_target_layers = hf.get("num_target_layers")
        ids = dflash.get("target_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise ConfigError("dflash_config.target_layer_ids: missing, and no num_target_layers to derive them")
            ids = default_target_layer_ids(int(num_target_layers), layer.num_layers)
        types = hf.get("layer_types") or ["full_attention"] * layer.num_layers
        if len(types) != layer.num_layers:
            raise ConfigError(f"layer_types: {len(types)} entries for {layer.num_layers} layers")
        # As transformers' Qwen3Config reads it: the window holds only with use_sliding_window; a sliding layer
        # without one attends over everything.
        window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
        softcap = draft_value(hf, "final_logit_softcapping")
        return cls(
            layer=layer,
            block_size=int(block_size),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            windows=tuple(window if kind == "sliding_attention" and window > 0 else None for kind in types),
            architecture=architecture,
            dspark=DSparkHeads.from_hf(hf) if dspark else None,
            embedding_scale=float(draft_value(hf, "input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value(hf, "output_multiplier", 1.0)),
            logit_softcap=float(softcap) if softcap else None,
        )


@dataclass(frozen=True)
class BlockStep:
    """One forward's rows: every request's new context rows first (written to the cache, never queries), then every
    request's block (planned bidirectional: tandem.layers.page_table)."""

    positions: torch.Tensor  # [contexts + blocks] the context rows' positions, then the block rows'
    context_slots: torch.Tensor  # [contexts] pool slots of the context rows
    block: AttentionMetadata  # the blocks' attention

    @property
    def num_context(self) -> int:
        return self.context_slots.shape[0]


class DFlashAttention(Attention):
    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,  # [contexts + blocks, hidden] context rows as they are, block rows normed
        step: BlockStep,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # -> [blocks, hidden]
        query, key, value, packed = self.project(hidden, step.positions)
        n = step.num_context
        keys, values = cache.keys[self.layer_index], cache.values[self.layer_index]
        keys.index_copy_(0, step.context_slots, key[:n].to(keys.dtype))
        values.index_copy_(0, step.context_slots, value[:n].to(values.dtype))
        attended = step.block.attention.attend(
            query[n:], key[n:], value[n:], keys, values, self.scaling, self.sliding_window
        )
        return self.output(attended, packed[n:])


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig, index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        layer = config.layer
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.self_attn = DFlashAttention(
            layer_index=index,
            input_size=layer.hidden_size,
            output_size=layer.hidden_size,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            rotary=rotary,
            qkv_bias=layer.traits.qkv_bias,
            o_bias=layer.traits.o_bias,
            qk_norm_eps=layer.rms_norm_eps,
            sliding_window=config.windows[index],
        )
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.mlp = GatedMLP(layer.hidden_size, layer.intermediate_size)

    def forward(
        self,
        block: torch.Tensor,  # [blocks, hidden] residual stream of the block rows
        context: torch.Tensor,  # [contexts, hidden] hidden_norm(fc(features)), the same for every layer
        step: BlockStep,
        cache: PagedKVCache,
    ) -> torch.Tensor:  # -> [blocks, hidden]
        block = block + self.self_attn(torch.cat([context, self.input_layernorm(block)]), step, cache)
        return block + self.mlp(self.post_attention_layernorm(block))


class MarkovHead(nn.Module):
    """DSpark's correction of a block row's logits from the token before it: W2 W1[previous] (vanilla), or
    W2 (sigmoid(gate_proj([hidden ; W1[previous]])) * W1[previous]) (gated; `gate` here)."""

    def __init__(self, heads: DSparkHeads, hidden: int, vocab: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, heads.markov_rank)
        self.markov_w2 = Linear(heads.markov_rank, vocab, bias=False)
        # `markov_head.gate_proj` in the checkpoint (BLOCK_NAME_MAP: not a gate/up part of an MLP).
        self.gate = Linear(hidden + heads.markov_rank, heads.markov_rank) if heads.markov_type == "gated" else None

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:  # [n, hidden], [n] -> [n, vocab]
        embedded = self.markov_w1(previous)
        if self.gate is not None:
            embedded = self.gate(torch.cat([hidden, embedded], dim=-1)).sigmoid() * embedded
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: one logit per row from [hidden ; W1[previous]] (with_markov) or the hidden."""

    def __init__(self, heads: DSparkHeads, hidden: int) -> None:
        super().__init__()
        self.with_markov = heads.confidence_with_markov
        self.proj = Linear(hidden + (heads.markov_rank if self.with_markov else 0), 1)


class DFlashDraft(nn.Module):
    """The block drafter: DFlash's backbone, and for DSpark its Markov and confidence heads."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        layer = config.layer
        hidden = layer.hidden_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, hidden)  # the target's
        self.rotary = RotaryEmbedding(layer.head_dim, layer.rope)
        self.layers = nn.ModuleList(DFlashLayer(config, index, self.rotary) for index in range(layer.num_layers))
        self.fc = Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.lm_head = Linear(hidden, layer.vocab_size, bias=False)  # the target's
        heads = config.dspark
        self.markov_head = MarkovHead(heads, hidden, layer.vocab_size) if heads and heads.markov_rank else None
        self.confidence_head = ConfidenceHead(heads, hidden) if heads is not None and heads.confidence else None

    def forward(
        self,
        block_ids: torch.Tensor,  # [blocks] every request's anchor and mask tokens
        features: torch.Tensor,  # [contexts, len(target_layer_ids) * hidden] the new context rows' target features
        step: BlockStep,
        cache: PagedKVCache,
        rows: torch.Tensor,  # [rows] the block rows that draft
    ) -> torch.Tensor:  # -> [rows, hidden] their final-norm outputs
        context = self.hidden_norm(self.fc(features))
        block = self.embed_tokens(block_ids)
        if self.config.embedding_scale != 1.0:
            block = block * self.config.embedding_scale
        for layer in self.layers:
            block = layer(block, context, step, cache)
        return self.norm(block[rows])

    def logits(self, hidden: torch.Tensor, previous: torch.Tensor | None = None) -> torch.Tensor:  # -> [n, vocab]
        """Draft logits (float32) of block rows ([n, hidden]) given the token before each ([n]: the anchor, then the
        drafts; DSpark's Markov correction needs them): the LM head's (head_logits), plus that correction."""
        logits = self.head_logits(hidden)
        if self.markov_head is None:
            return logits
        if previous is None:
            raise ValueError("a DSpark draft's logits need the token before each row")
        return logits + self.markov_head(hidden, previous).float()

    @property
    def row_by_row(self) -> bool:
        """Whether a row's draft depends on the one before (a Markov head here; DFlash2's selector)."""
        return self.markov_head is not None

    def choose(self, logits: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The drafts ([n]) of rows from their (shaped) logits ([n, vocab]), outputs ([n, hidden]) and the token
        before each ([n]): the argmax here; DFlash2 walks its selector (tandem.models.dflash2)."""
        return logits.argmax(dim=-1)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # -> [n, vocab] float32
        """The LM head's logits, scaled and capped as the config says; no Markov correction."""
        config = self.config
        logits = self.lm_head(hidden).float() * config.output_multiplier
        if config.logit_softcap is not None:
            logits = torch.tanh(logits / config.logit_softcap) * config.logit_softcap
        return logits

    def confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:  # -> [n] in (0, 1)
        """DSpark's calibrated chance that each row's draft is accepted given the ones before it; None without a
        confidence head."""
        return None if self.confidence_head is None else self.confidence_logits(hidden, previous).sigmoid()

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [...]
        """The confidence head's logit of each row (the model must have the head)."""
        assert self.confidence_head is not None
        if self.confidence_head.with_markov and self.markov_head is not None:  # with_markov implies the head
            hidden = torch.cat([hidden, self.markov_head.markov_w1(previous)], dim=-1)
        return self.confidence_head.proj(hidden).float().squeeze(-1)

    def fill_table(self, name: str, table: torch.Tensor) -> None:
        """Copies the target's `embed_tokens` or `lm_head` ([vocab, hidden]) into the draft."""
        module = self.embed_tokens if name == "embed_tokens" else self.lm_head
        module.weight.data.copy_(table)


def load_dflash(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[DFlashDraft, tuple[str, ...]]:
    """Loads a DFlash or DSpark drafter; returns it and the shared tables its checkpoint lacks (DFlash's never has
    them, a DSpark checkpoint may), left NaN until `fill_table` fills them from the target."""
    config = DFlashConfig.from_hf(read_hf_config(model_dir))
    if config.architecture in DFLASH2_ARCHITECTURES:  # its convolutions and selector would go unread
        raise ConfigError(f"{model_dir}: a DFlash2 draft; load it with tandem.models.dflash2.load_block_draft")
    return load_block_weights(model_dir, lambda: DFlashDraft(config), dtype, device)


def load_block_weights(
    model_dir: Path, build: Callable[[], DFlashDraft], dtype: torch.dtype, device: str
) -> tuple[DFlashDraft, tuple[str, ...]]:
    """The drafter `build` makes, with the checkpoint's weights, and the shared tables the checkpoint lacks."""
    model = materialized(on_meta(build), device, dtype)
    for name in SHARED_TABLES:
        getattr(model, name).weight.data.fill_(float("nan"))
    optional = frozenset(f"{name}.weight" for name in SHARED_TABLES)
    load_weights(model, iter_tensors(model_dir), BLOCK_NAME_MAP, source=str(model_dir), optional=optional)
    missing = tuple(name for name in SHARED_TABLES if not checkpoint_has(model_dir, f"{name}.weight"))
    model.eval()
    return model, missing
