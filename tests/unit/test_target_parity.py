"""Our Llama-family target on the paged KV cache against transformers, on tiny random checkpoints (fp32).

Covered: one prefill, prefill then decode chunks (sequences span several blocks), and several sequences of
different lengths packed in one forward. Aux capture index i must equal the residual stream entering layer i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target

TOLERANCE = 1e-4
BLOCK_SIZE = 4  # small, so that every sequence here spans several blocks
NUM_BLOCKS = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 10000 the wavelengths run from 6 to 20000: some below 32 (kept), one between
    # 32 and 128 (interpolated), the rest above 128 (slowed down), so all three bands of the rule are used.
    "original_max_position_embeddings": 128,
}
SPECS = {
    "llama": TinyTargetSpec(family="llama"),
    "llama-rope-llama3": TinyTargetSpec(family="llama", rope_scaling=LLAMA3_ROPE),
    "llama-rope-linear": TinyTargetSpec(family="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-tied": TinyTargetSpec(family="qwen2", tie_word_embeddings=True),
    "qwen3": TinyTargetSpec(family="qwen3"),
    "llama-sharded": TinyTargetSpec(family="llama", sharded=True),
}


@dataclass(frozen=True)
class Models:
    ours: LlamaForCausalLM
    reference: PreTrainedModel


@dataclass(frozen=True)
class Reference:
    logits: torch.Tensor  # [sequence, vocab]
    streams: list[torch.Tensor]  # num_layers + 1 tensors [sequence, hidden]; i = residual stream entering layer i


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = write_tiny_target(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return Models(ours=load_target(Path(directory)), reference=reference)


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


def make_cache(model: LlamaForCausalLM) -> PagedKVCache:
    config = model.config
    return PagedKVCache(config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float32)


def run_chunks(
    model: LlamaForCausalLM,
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
        for index, span in zip(active, metadata.spans, strict=True):
            rows = slice(span.query_start, span.query_start + span.query_len)
            logits[index].append(step_logits[rows])
            for capture_index in capture:
                captured[index][capture_index].append(output.captured[capture_index][rows])
    return (
        [torch.cat(parts) for parts in logits],
        [{index: torch.cat(parts) for index, parts in streams.items()} for streams in captured],
    )


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


def test_single_prefill(models: Models) -> None:
    prompt = token_ids(11, seed=1)
    logits, captured = run_chunks(models.ours, [[prompt]])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, prompt))


@pytest.mark.parametrize("chunk_sizes", [[5, 1, 1, 1, 1, 1], [3, 4, 4, 1, 4], [1, 1, 4, 1, 4, 2]])
def test_prefill_then_decode_chunks(models: Models, chunk_sizes: list[int]) -> None:
    sequence = token_ids(sum(chunk_sizes), seed=2)
    logits, captured = run_chunks(models.ours, [split(sequence, chunk_sizes)])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, sequence))


def test_packed_batch_of_three_sequences(models: Models) -> None:
    # Step 0 prefills all three together (lengths 7, 3 and 9); later steps mix decode chunks of 1 and 4 tokens,
    # and the second sequence stops early, so later steps pack fewer sequences.
    sequences = [token_ids(13, seed=3), token_ids(4, seed=4), token_ids(14, seed=5)]
    chunk_sizes = [[7, 1, 4, 1], [3, 1], [9, 4, 1]]
    chunks = [split(sequence, sizes) for sequence, sizes in zip(sequences, chunk_sizes, strict=True)]
    logits, captured = run_chunks(models.ours, chunks)
    for index, sequence in enumerate(sequences):
        assert_matches(logits[index], captured[index], reference_forward(models.reference, sequence))


def test_capture_only_what_is_asked(models: Models) -> None:
    model = models.ours
    cache = make_cache(model)
    metadata = cache.plan([(SequenceKV(), 5)])
    with torch.no_grad():
        output = model(torch.tensor(token_ids(5, seed=6)), metadata, cache, capture=[1, model.config.num_layers])
    assert sorted(output.captured) == [1, model.config.num_layers]
