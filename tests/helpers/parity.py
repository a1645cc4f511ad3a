"""Comparing our models with Hugging Face transformers: the reference forward and the tolerance that the
parity tests of every target family share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.registry import TargetModel

TOLERANCE = 1e-4
BLOCK_SIZE = 4  # small, so that every sequence here spans several blocks
NUM_BLOCKS = 64


@dataclass(frozen=True)
class Reference:
    logits: torch.Tensor  # [sequence, vocab]
    streams: list[torch.Tensor]  # num_layers + 1 tensors [sequence, hidden]; i = residual stream entering layer i


def reference_forward(model: PreTrainedModel, token_ids: Sequence[int]) -> Reference:
    """Runs transformers on one whole sequence; the last stream is taken before the final norm by a hook."""
    final_outputs: list[torch.Tensor] = []

    def keep_output(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        final_outputs.append(output[0] if isinstance(output, tuple) else output)

    decoder: Any = model.get_decoder()
    handle = decoder.layers[-1].register_forward_hook(keep_output)
    try:
        with torch.no_grad():
            output = model(torch.tensor([list(token_ids)]), output_hidden_states=True)
    finally:
        handle.remove()
    # hidden_states[i] (i < L) is the input to layer i; hidden_states[L] comes after the final norm, so it is not used.
    num_layers = len(decoder.layers)
    streams = [output.hidden_states[index][0] for index in range(num_layers)] + [final_outputs[0][0]]
    return Reference(logits=output.logits[0], streams=streams)


def split(token_ids: Sequence[int], chunk_sizes: Sequence[int]) -> list[list[int]]:
    assert sum(chunk_sizes) == len(token_ids)
    chunks, start = [], 0
    for size in chunk_sizes:
        chunks.append(list(token_ids[start : start + size]))
        start += size
    return chunks


def assert_matches(
    logits: torch.Tensor,  # [length, vocab]
    captured: dict[int, torch.Tensor],  # capture index -> [length, hidden]
    reference: Reference,
) -> None:
    assert logits.dtype == torch.float32
    assert logits.shape == reference.logits.shape
    assert (logits - reference.logits).abs().max().item() <= TOLERANCE
    assert sorted(captured) == list(range(len(reference.streams)))
    for index, stream in enumerate(reference.streams):
        assert (captured[index] - stream).abs().max().item() <= TOLERANCE, f"capture index {index}"


def token_ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (length,), generator=generator).tolist()


def make_cache(model: TargetModel) -> PagedKVCache:
    config = model.config
    layout = config.cache_layout
    return PagedKVCache(
        config.num_layers,
        NUM_BLOCKS,
        BLOCK_SIZE,
        layout.num_kv_heads,
        layout.key_dim,
        torch.float32,
        value_dim=layout.value_dim,
    )


def run_chunks(
    model: TargetModel,
    chunks_per_sequence: Sequence[Sequence[Sequence[int]]],  # [sequence][step] -> token ids of that step
) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """Feeds every sequence its chunks, one packed forward per step; a sequence with no chunk left sits out.

    Returns, per sequence, the logits of all its tokens [length, vocab] and its captured streams
    (capture index -> [length, hidden]), concatenated over the steps.
    """
    cache = make_cache(model)
    capture = list(range(model.config.num_layers + 1))
    sequences = [SequenceKV() for _ in chunks_per_sequence]
    logits: list[list[torch.Tensor]] = [[] for _ in chunks_per_sequence]
    captured: list[dict[int, list[torch.Tensor]]] = [{index: [] for index in capture} for _ in chunks_per_sequence]
    num_steps = max(len(chunks) for chunks in chunks_per_sequence)
    for step in range(num_steps):
        active = [index for index, chunks in enumerate(chunks_per_sequence) if step < len(chunks)]
        metadata = cache.plan([(sequences[index], len(chunks_per_sequence[index][step])) for index in active])
        input_ids = torch.tensor([token for index in active for token in chunks_per_sequence[index][step]])
        with torch.no_grad():
            output = model(input_ids, metadata, cache, capture)
            step_logits = model.compute_logits(output.normed)
        for index, rows in zip(active, metadata.page_table.query_slices(), strict=True):
            logits[index].append(step_logits[rows])
            for capture_index in capture:
                captured[index][capture_index].append(output.captured[capture_index][rows])
    return (
        [torch.cat(parts) for parts in logits],
        [{index: torch.cat(parts) for index, parts in streams.items()} for streams in captured],
    )
