"""Step-3.5's MTP layers as a family of tandem.models.mtp: what a layer's block is and how it turns.

Step-3.5-Flash and Step-3.7-Flash store num_nextn_predict_layers (3) MTP layers after the last decoder layer,
`model.layers.{L + k}.*`: enorm, hnorm, eh_proj, shared_head.norm (all (1 + w) norms, like every Step-3.5 norm),
sometimes their own LM head `shared_head.output`, and a Step-3.5 decoder layer (tandem.models.step3p5), whose
weights some releases keep under `.transformer.`. Each block is a layer of the model that
step3p5_config.mtp_layers_config describes (usually dense, full or sliding attention, with the target's rope for
its attention kind), and keeps its KV in cache layer 0 of the MTP runner's one-layer pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tandem.layers.kv_cache import CacheLayout
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.step3p5 import Step3p5DecoderLayer
from tandem.models.step3p5_config import Step3p5Config, mtp_layers_config
from tandem.parallel.group import SINGLE_PROCESS


@dataclass(frozen=True)
class Step3p5MTPConfig:
    """The target's config (its shapes and layer count name the checkpoint's MTP layers) and the MTP layers'."""

    target: Step3p5Config
    layers: Step3p5Config  # the MTP layers as a model of num_nextn_predict_layers layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Step3p5MTPConfig:
        return cls(target=Step3p5Config.from_hf(hf), layers=mtp_layers_config(hf))

    @property
    def architecture(self) -> str:
        return self.target.architecture

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def num_layers(self) -> int:
        return self.target.num_layers

    @property
    def rms_norm_eps(self) -> float:
        return self.target.rms_norm_eps

    @property
    def tie_word_embeddings(self) -> bool:
        return self.target.tie_word_embeddings

    @property
    def cache_layout(self) -> CacheLayout:
        return self.target.cache_layout


class Step3p5Rotaries(nn.Module):
    """The full layers' and the sliding layers' rope, shared by every MTP layer of that attention kind."""

    def __init__(self, config: Step3p5MTPConfig) -> None:
        super().__init__()
        full, sliding = config.layers.ropes
        self.full = RotaryEmbedding(full.rotary_dim, full.rope)
        self.sliding = RotaryEmbedding(sliding.rotary_dim, sliding.rope)


def step3p5_mtp_block(config: Step3p5MTPConfig, layer_index: int, rotaries: Step3p5Rotaries) -> nn.Module:
    """The decoder layer of checkpoint layer `layer_index` = L + k: layer k of the MTP layers' model, on cache
    layer 0 (each MTP layer has its own one-layer KV sequences)."""
    index = layer_index - config.num_layers
    rotary = rotaries.sliding if config.layers.sliding_layers[index] else rotaries.full
    layer = Step3p5DecoderLayer(config.layers, index, rotary, SINGLE_PROCESS)
    layer.self_attn.layer_index = 0
    return layer
