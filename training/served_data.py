"""Training data from any served target: its greedy continuations with the rows its drafters read.

The target is the model the target server runs (tandem.models.registry.load_target), driven through its paged KV
cache as the server drives it: one prefill of the batch's prompts, then one token per sequence a step. Any capture
index the target serves can be collected, so one pass feeds drafters of several kinds: aux streams (EAGLE3, block
drafters), the final normed hidden (num_layers + 1) and, on Gemma 4, a kept layer's keys and values (num_layers + 2
+ layer, what its assistant reads).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.registry import TargetModel
from training.eagle3 import DraftData

BLOCK_SIZE = 16


@torch.no_grad()
def served_greedy(
    target: TargetModel,
    prompts: torch.Tensor,  # [batch, prompt_length]
    num_new: int,
    capture: tuple[int, ...],
) -> DraftData:
    """The prompts continued greedily by `num_new` tokens; argmax[:, t] is the target's token for t + 1 and
    features[:, t] the captured rows of position t, in `capture` order (bf16)."""
    batch, length = prompts.shape
    layout = target.cache_layout
    blocks_each = -(-(length + num_new + 1) // BLOCK_SIZE)
    cache = PagedKVCache(
        target.config.num_layers,
        batch * blocks_each,
        BLOCK_SIZE,
        layout.num_kv_heads,
        layout.key_dim,
        next(target.parameters()).dtype,
        value_dim=layout.value_dim,
    )
    sequences = [SequenceKV() for _ in range(batch)]
    inputs, tokens, argmaxes, features = prompts, [prompts], [], []
    for _ in range(num_new + 1):
        rows = inputs.shape[1]
        metadata = cache.plan([(sequence, rows) for sequence in sequences])
        output = target(inputs.flatten(), metadata, cache, capture)
        predicted = target.compute_logits(output.normed).argmax(dim=-1).view(batch, rows)
        argmaxes.append(predicted)
        captured = torch.cat([output.normed[:, :0], *(output.captured[index] for index in capture)], dim=-1)
        features.append(captured.to(torch.bfloat16).view(batch, rows, -1))
        inputs = predicted[:, -1:]
        tokens.append(inputs)
    # The last pass scored the final generated token; its own successor is dropped from the tokens.
    return DraftData(torch.cat(tokens[:-1], dim=1), torch.cat(argmaxes, dim=1), torch.cat(features, dim=1))


def served_continuations(
    target: TargetModel,
    prompts: torch.Tensor,  # [num_sequences, prompt_length]
    num_new: int,
    capture: tuple[int, ...],
    batch_size: int,
) -> DraftData:
    parts = [
        served_greedy(target, prompts[first : first + batch_size], num_new, capture)
        for first in tqdm(range(0, prompts.shape[0], batch_size), desc="continuations", unit="batch")
    ]
    return DraftData(*(torch.cat([getattr(part, name) for part in parts]) for name in ("tokens", "argmax", "features")))
