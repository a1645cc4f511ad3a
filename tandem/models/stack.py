"""What every target family shares: running the decoder stack with aux hidden-state capture."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.kv_cache import PagedKVCache


@dataclass(frozen=True)
class TargetOutput:
    normed: torch.Tensor  # [num_tokens, hidden] final-norm output, the LM-head input
    captured: dict[int, torch.Tensor]  # capture index -> [num_tokens, hidden] (see run_layers)


def run_layers(
    hidden: torch.Tensor,  # [num_tokens, hidden] the embedded input
    layers: Iterable[nn.Module],
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
            captured[index] = hidden
        hidden = layer(hidden, metadata, cache)
    if index + 1 in wanted:
        captured[index + 1] = hidden
    normed = norm(hidden)
    if index + 2 in wanted:
        captured[index + 2] = normed
    return TargetOutput(normed=normed, captured=captured)
