"""Our Llama-family target on the paged KV cache against transformers, on tiny random checkpoints (fp32).

Covered: one prefill, prefill then decode chunks (sequences span several blocks), and several sequences of
different lengths packed in one forward. Aux capture index i must equal the residual stream entering layer i.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from tandem.layers.kv_cache import SequenceKV
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.parity import assert_matches, make_cache, reference_forward, run_chunks, split, token_ids

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


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = write_tiny_target(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return Models(ours=load_target(Path(directory)), reference=reference)


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
