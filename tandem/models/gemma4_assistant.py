"""Gemma 4's assistant drafter (Gemma4AssistantForCausalLM, model_type gemma4_assistant), as transformers 5.24 runs it.

A small Gemma 4 text model whose layers all read the TARGET's keys and values: each layer has only q_proj, q_norm
and o_proj, and attends over the K/V rows (post-norm, post-RoPE, as the target's attention keeps them) of the
target's last K/V-keeping layer of its own type (one sliding, one full). A draft step at position p:

    x = pre_projection(concat(target's scaled embedding of token, hidden))     [backbone] * 2 -> [hidden]
    x = text model layers at position p (no K/V of its own), then the final norm
    logits = lm_head(x) (tied to the assistant's own table) or, with ordered embeddings, the centroid head
    hidden' = post_projection(x)                                                 [hidden] -> [backbone]

Every step of a round sits at the same position p, the position of the first token the target has not run yet;
the first step takes that token and the target's final (normed) hidden state of the position before it, later steps
the previous step's draft and hidden'. A full layer attends to every row given; a sliding layer to the last
`sliding_window + 1` of them (transformers' bidirectional window over the shared rows, distance <= window).

The centroid head (`use_ordered_embeddings`): the vocabulary is ordered into `num_centroids` clusters of equal size
(`token_ordering` lists the token ids cluster by cluster); the top `centroid_intermediate_top_k` clusters by
centroid logit are scored against the LM head's rows of their tokens, and every other token gets the smallest of
those scores minus 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear import PackedLinear
from tandem.layers.matmul import Linear
from tandem.layers.mlp import GatedMLP
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.config import ConfigError, read_hf_config
from tandem.models.gemma4 import scaled
from tandem.models.gemma4_config import Gemma4Config
from tandem.parallel.group import SINGLE_PROCESS
from tandem.weights.loader import NameMap, iter_tensors, load_weights, materialized, on_meta

ARCHITECTURE = "Gemma4AssistantForCausalLM"
# Keys and values a layer type reads for one request: [rows, num_kv_heads, head_dim] each.
Rows = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CentroidHead:
    num_centroids: int
    top_k: int  # centroid_intermediate_top_k


@dataclass(frozen=True)
class AssistantConfig:
    text: Gemma4Config  # the assistant's own layers (each reads the target's K/V of its type)
    backbone_hidden_size: int  # the target's hidden size
    centroids: CentroidHead | None  # use_ordered_embeddings
    tie_word_embeddings: bool

    @property
    def sliding(self) -> tuple[bool, ...]:  # per layer: whether it is a sliding layer
        return tuple(layer.sliding for layer in self.text.layers)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> AssistantConfig:
        text = dict(hf.get("text_config") or {})
        refused = {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        }
        for key, needed in refused.items():
            if text.get(key, needed) not in (needed, None):
                raise ConfigError(f"text_config.{key}: {text[key]!r}; a Gemma 4 assistant has {needed!r}")
        # Every layer reads the target's K/V; parsed as if each kept its own, which only its shapes matter for.
        text |= {
            "architectures": [ARCHITECTURE],
            "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
        }
        ordered = bool(hf.get("use_ordered_embeddings", False))
        centroids = CentroidHead(int(hf.get("num_centroids", 2048)), int(hf.get("centroid_intermediate_top_k", 32)))
        config = cls(
            text=Gemma4Config.from_hf(text),
            backbone_hidden_size=int(hf.get("backbone_hidden_size", 1536)),
            centroids=centroids if ordered else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )
        if config.centroids is not None and config.text.vocab_size % config.centroids.num_centroids:
            raise ConfigError(
                f"num_centroids: {config.centroids.num_centroids} does not divide vocab_size {config.text.vocab_size}"
            )
        return config


class AssistantAttention(nn.Module):
    """Queries only: q_proj, q_norm, the rotation at the step's position, attention over the given rows, o_proj."""

    def __init__(self, config: Gemma4Config, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        spec = config.layers[layer_index]
        self.num_heads, self.head_dim = config.num_heads, spec.head_dim
        self.window = config.sliding_window + 1 if spec.sliding else None  # rows a sliding layer reads (docstring)
        self.qkv_proj = PackedLinear(config.hidden_size, {"q": self.num_heads * self.head_dim}, config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(spec.head_dim, config.rms_norm_eps, float32_scale=True)
        self.rotary = rotary

    def forward(
        self,
        hidden: torch.Tensor,  # [b, hidden] normed, one query per request
        positions: torch.Tensor,  # [b]
        rows: list[Rows],  # per request, the target's K/V rows of this layer's type
    ) -> torch.Tensor:  # -> [b, hidden]
        query = self.q_norm(self.qkv_proj(hidden).view(-1, self.num_heads, self.head_dim))
        query = self.rotary.rotate(positions, query)  # [b, heads, head_dim]
        attended = []
        for index, (keys, values) in enumerate(rows):
            if self.window is not None:
                keys, values = keys[-self.window :], values[-self.window :]
            attended.append(
                F.scaled_dot_product_attention(
                    query[index].unsqueeze(1),  # [heads, 1, head_dim]
                    keys.transpose(0, 1),  # [kv heads, rows, head_dim]
                    values.transpose(0, 1),
                    scale=1.0,
                    enable_gqa=True,
                ).squeeze(1)
            )
        return self.o_proj(torch.stack(attended).flatten(1))


class AssistantLayer(nn.Module):
    layer_scalar: torch.Tensor  # [1], loaded from the checkpoint

    def __init__(self, config: Gemma4Config, layer_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.self_attn = AssistantAttention(config, layer_index, rotary)
        self.post_attention_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, float32_scale=True)
        intermediate = config.layers[layer_index].intermediate_size
        self.mlp = GatedMLP(size, intermediate, config.hidden_activation, SINGLE_PROCESS)
        self.post_feedforward_layernorm = RMSNorm(size, eps, float32_scale=True)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rows: list[Rows]) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), positions, rows))
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden * self.layer_scalar


class AssistantModel(nn.Module):
    """The checkpoint's `model`: its table (the tied LM head's), layers and final norm."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        dims = {spec.sliding: spec.head_dim for spec in config.layers}
        rotaries = {
            True: RotaryEmbedding(dims.get(True, config.head_dim), config.sliding_rope),
            False: RotaryEmbedding(dims.get(False, config.head_dim), config.full_rope),
        }
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AssistantLayer(config, index, rotaries[spec.sliding]) for index, spec in enumerate(config.layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, float32_scale=True)


class MaskedEmbedder(nn.Module):
    """The centroid head (module docstring): centroids [C, hidden], token_ordering [vocab]."""

    token_ordering: torch.Tensor

    def __init__(self, hidden_size: int, vocab_size: int, head: CentroidHead) -> None:
        super().__init__()
        self.centroids = Linear(hidden_size, head.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab_size, dtype=torch.long))
        self.head = head

    def forward(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # [b, hidden] -> [b, vocab]
        chosen = self.centroids(hidden).topk(self.head.top_k, dim=-1).indices  # [b, top_k]
        clusters = self.token_ordering.view(self.head.num_centroids, -1)  # [C, vocab / C]
        tokens = clusters[chosen].flatten(1)  # [b, top_k * vocab / C] token ids
        scores = torch.einsum("bh,bth->bt", hidden, table[tokens])
        logits = torch.full((hidden.shape[0], table.shape[0]), float(scores.min()) - 1.0, dtype=hidden.dtype)
        return logits.to(hidden.device).scatter_(-1, tokens, scores)


class Gemma4Assistant(nn.Module):
    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        text = config.text
        self.config = config
        self.model = AssistantModel(text)
        self.pre_projection = Linear(2 * config.backbone_hidden_size, text.hidden_size, bias=False)
        self.post_projection = Linear(text.hidden_size, config.backbone_hidden_size, bias=False)
        self.lm_head = None if config.tie_word_embeddings else Linear(text.hidden_size, text.vocab_size, bias=False)
        heads = config.centroids
        self.masked_embedding = None if heads is None else MaskedEmbedder(text.hidden_size, text.vocab_size, heads)
        # The target's raw token table, filled at start-up from the target (GetWeights "embed_tokens").
        self.target_embed = nn.Embedding(text.vocab_size, config.backbone_hidden_size)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:  # [b] -> [b, backbone] as the target embeds them
        return scaled(self.target_embed(tokens), self.config.backbone_hidden_size**0.5)

    def forward(
        self,
        tokens: torch.Tensor,  # [b] the token at each request's position
        hidden: torch.Tensor,  # [b, backbone] the target's hidden before it, or the previous step's
        positions: torch.Tensor,  # [b]
        rows: list[dict[bool, Rows]],  # per request, by layer type (sliding?), the target's K/V rows
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> logits [b, vocab], hidden [b, backbone]
        x = self.pre_projection(torch.cat([self.embed(tokens), hidden], dim=-1))
        for layer, sliding in zip(self.model.layers, self.config.sliding, strict=True):
            x = layer(x, positions, [held[sliding] for held in rows])
        x = self.model.norm(x)
        table = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        heads = self.masked_embedding
        logits = F.linear(x, table) if heads is None else heads(x, table)
        return logits, self.post_projection(x)


def capture_indices(num_layers: int, kept_layers: Iterable[int]) -> tuple[int, ...]:
    """The target capture indices of the rows an assistant reads, in the order its replica lays them out: the final
    normed hidden (num_layers + 1), then each kept layer's keys and values (num_layers + 2 + layer)."""
    return (num_layers + 1, *(num_layers + 2 + layer for layer in kept_layers))


def load_assistant(model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Gemma4Assistant:
    """The assistant as saved by save_pretrained; its `target_embed` is left poisoned (NaN) for the target's table."""
    hf = read_hf_config(model_dir)
    if hf.get("model_type") != "gemma4_assistant":
        raise ConfigError(f"model_type: {hf.get('model_type')!r}, a Gemma 4 assistant has 'gemma4_assistant'")
    model = materialized(on_meta(lambda: Gemma4Assistant(AssistantConfig.from_hf(hf))), device, dtype)
    model.target_embed.weight.data.fill_(float("nan"))
    optional = frozenset({"target_embed.weight"})
    load_weights(model, iter_tensors(model_dir), NameMap(), source=str(model_dir), optional=optional)
    return model.eval()
