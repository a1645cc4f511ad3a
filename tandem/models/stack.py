"""What every target family shares: the pre-norm decoder layer, the decoder stack with aux hidden-state capture, and
the causal-LM wrapper around a family's backbone.

A family module only builds the parts that differ (its attention, its MLP, its backbone's embedding and rotary
tables) and hands them to these blocks; its variants are the blocks' flags (`sandwich_norms`, `unit_offset`,
`embedding_scale`, `logit_softcap`). Module names are the checkpoints' (model.layers.N.self_attn...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import CacheLayout, PagedKVCache
from tandem.layers.matmul import Linear
from tandem.layers.norm import RMSNorm
from tandem.parallel.group import ParallelGroup


@dataclass(frozen=True)
class TargetOutput:
    normed: torch.Tensor  # [num_tokens, hidden] final-norm output, the LM-head input
    captured: dict[int, torch.Tensor]  # capture index -> [num_tokens, hidden] (see run_layers)


@dataclass(frozen=True)
class KeptKV:
    """A layer whose keys and values a drafter may read (capture index num_layers + 2 + layer): their shapes over
    every rank."""

    layer: int
    sliding: bool
    num_kv_heads: int
    head_dim: int


def run_layers(
    hidden: torch.Tensor,  # [num_tokens, hidden] the embedded input
    layers: Iterable[Callable[[torch.Tensor, AttentionMetadata, PagedKVCache], torch.Tensor]],  # modules, or calls
    norm: nn.Module,
    metadata: AttentionMetadata,
    cache: PagedKVCache,
    capture: Sequence[int],  # capture indices in [0, num_layers + 1], see below
) -> TargetOutput:
    """Runs the layers; capture index i keeps the residual stream entering layer i, index num_layers the stream
    leaving the last layer, before the final norm, and index num_layers + 1 the final norm's output (what a
    DeepSeek NextN draft layer consumes)."""
    wanted = set(capture)
    captured: dict[int, torch.Tensor] = {}
    index = 0
    for index, layer in enumerate(layers):
        if index in wanted:
            # A copy: a layer that updated its input in place would otherwise change the rows already captured
            # (SGLang #39286 saw that on Gemma 4; test_gemma_eagle3 compares every index with transformers).
            captured[index] = hidden.clone()
        hidden = layer(hidden, metadata, cache)
    if index + 1 in wanted:
        captured[index + 1] = hidden
    normed = norm(hidden)
    if index + 2 in wanted:
        captured[index + 2] = normed
    return TargetOutput(normed=normed, captured=captured)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer around a family's attention (`self_attn`: grouped-query or MLA) and MLP (dense or
    mixture of experts):

        hidden = hidden + self_attn(input_layernorm(hidden))
        hidden = hidden + mlp(post_attention_layernorm(hidden))

    With `sandwich_norms` (Gemma3) the outputs of attention and MLP are normalised too, under the checkpoint's
    names for that layout:

        hidden = hidden + post_attention_layernorm(self_attn(input_layernorm(hidden)))
        hidden = hidden + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(hidden)))

    `unit_offset` makes every norm (1 + weight) RMSNorm (tandem.layers.norm). An EAGLE3 head passes its own
    `attention_input` (concat([embedding, hidden]), 2*hidden wide) instead of the normed residual stream.
    """

    def __init__(
        self,
        self_attn: nn.Module,  # (attention input, metadata, cache) -> [num_tokens, hidden]
        mlp: nn.Module,  # [num_tokens, hidden] -> [num_tokens, hidden]
        hidden_size: int,
        eps: float,
        unit_offset: bool = False,
        sandwich_norms: bool = False,
    ) -> None:
        super().__init__()
        # Registered in the checkpoint's order, so that parameters list as they always did.
        self.input_layernorm = RMSNorm(hidden_size, eps, unit_offset)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, unit_offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, unit_offset) if sandwich_norms else None
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, unit_offset) if sandwich_norms else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] residual stream entering the layer
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        attention_input: torch.Tensor | None = None,  # [num_tokens, attention input size]; default: normed hidden
    ) -> torch.Tensor:  # -> [num_tokens, hidden] residual stream leaving the layer
        if attention_input is None:
            attention_input = self.input_layernorm(hidden)
        attended = self.self_attn(attention_input, metadata, cache)  # [num_tokens, hidden]
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden = hidden + attended
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Backbone(nn.Module):
    """The checkpoint's `model.` part of a causal LM, as a family's backbone builds it (with the rotary tables its
    layers share)."""

    embed_tokens: nn.Embedding  # the raw table, as stored in the checkpoint
    layers: nn.ModuleList
    norm: RMSNorm


class CausalLMConfig(Protocol):
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def cache_layout(self) -> CacheLayout: ...  # what one token leaves in one layer of the whole KV cache


ConfigT = TypeVar("ConfigT", bound=CausalLMConfig)
# Rows of a step's tokens [n] int64 and the embeddings they take instead of their token's [n, hidden]: an image's
# features at its placeholder tokens.
Embeddings = tuple[torch.Tensor, torch.Tensor]


def replaced(embedded: torch.Tensor, embeddings: Embeddings | None) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
    """The embedded tokens with the given rows' embeddings in place of their token's."""
    if embeddings is None:
        return embedded
    rows, values = embeddings
    return embedded.index_copy(0, rows, values.to(embedded.dtype))


class CausalLM(nn.Module, Generic[ConfigT]):
    """A family's backbone with its LM head: the interface every target offers (tandem.models.registry.TargetModel).

    `embedding_scale` multiplies the embedded tokens (Gemma3: sqrt(hidden)); `logit_softcap` caps the logits as
    cap * tanh(logits / cap) (Gemma3's final_logit_softcapping). Tensor parallel: a rank's KV cache holds its share
    of the KV heads (`cache_layout`).
    """

    def __init__(
        self,
        config: ConfigT,
        group: ParallelGroup,
        backbone: Backbone,
        lm_head: Linear,
        embedding_scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.group = group
        self.model = backbone
        self.lm_head = lm_head
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embedding_scale = embedding_scale
        self.logit_softcap = logit_softcap

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        cache: PagedKVCache,  # laid out as cache_layout
        capture: Sequence[int] = (),  # capture indices in [0, num_layers + 1] (run_layers)
        embeddings: Embeddings | None = None,  # rows whose embedding is given (an image's tokens), after the scale
    ) -> TargetOutput:
        hidden = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.embedding_scale is not None:
            # The scale is rounded to the model dtype before the multiply, as transformers does (sqrt(3072) -> 55.5
            # in bfloat16), so that bf16 streams match the reference bit for bit.
            scale = torch.tensor(self.embedding_scale, dtype=torch.float32, device=hidden.device)
            hidden = hidden * scale.to(hidden.dtype)
        hidden = replaced(hidden, embeddings)
        return run_layers(hidden, self.model.layers, self.model.norm, metadata, cache, capture)

    @property
    def kept_kv(self) -> tuple[KeptKV, ...]:
        """Layers whose keys and values a drafter may take as capture rows (tandem.models.gemma4); most have none."""
        return ()

    @property
    def cache_layout(self) -> CacheLayout:
        """What one token leaves in one layer of this rank's KV cache: its share of the KV heads."""
        layout = self.config.cache_layout
        return CacheLayout(layout.num_kv_heads // self.group.world_size, layout.key_dim, layout.value_dim)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        logits = self.lm_head(normed).float()
        cap = self.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)
