"""Our Gemma3 text target on the paged KV cache against transformers' Gemma3ForCausalLM, on tiny random checkpoints.

The checkpoints have a sliding window of 8 and sequences of 20 to 26 tokens, so every local layer's window cuts off
the start of the context, in prefill, in multi-token chunks over cached context and in single-token decodes. Layer
types are mixed (local, local, global, local), both rope bases differ from the defaults and the global one is
linearly scaled, and query_pre_attn_scalar differs from head_dim, so a layer given the wrong rope, window or scale
shows. The parity harness (chunked runs, reference streams, tolerances) is the Llama-family one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig, PreTrainedModel

from tandem.layers.kv_cache import SequenceKV
from tandem.models.config import ConfigError, RopeConfig
from tandem.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from tandem.models.registry import load_target, target_architecture
from tests.helpers.gemma3_checkpoints import LOCAL, SPECS, write_tiny_gemma3
from tests.helpers.parity import (
    TOLERANCE,
    assert_matches,
    make_cache,
    reference_forward,
    run_chunks,
    split,
    token_ids,
)


@dataclass(frozen=True)
class Models:
    directory: Path
    ours: Gemma3ForCausalLM
    reference: PreTrainedModel


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = write_tiny_gemma3(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(directory)
    assert isinstance(ours, Gemma3ForCausalLM)
    return Models(directory, ours, reference)


@pytest.mark.parametrize(
    "chunk_sizes",
    [
        [24],  # one prefill, 3 windows long
        [12, 1, 1, 5, 1, 4],  # prefill past the window, then decodes and chunks over a context longer than it
        [3, 4, 4, 1, 4, 1, 4, 1],  # the window is crossed inside a decode chunk
    ],
)
def test_prefill_then_decode_chunks_match_transformers(models: Models, chunk_sizes: list[int]) -> None:
    sequence = token_ids(sum(chunk_sizes), seed=2)
    logits, captured = run_chunks(models.ours, [split(sequence, chunk_sizes)])
    # Capture covers every index 0..num_layers, num_layers being the final stream before the final norm.
    assert_matches(logits[0], captured[0], reference_forward(models.reference, sequence))


def test_packed_batch_of_three_sequences(models: Models) -> None:
    # One packed forward per step: all three prefill together, then they mix chunks and decodes; the second
    # sequence (shorter than the window) stops early.
    sequences = [token_ids(22, seed=3), token_ids(7, seed=4), token_ids(25, seed=5)]
    chunk_sizes = [[10, 1, 4, 7], [3, 1, 3], [12, 4, 1, 8]]
    chunks = [split(sequence, sizes) for sequence, sizes in zip(sequences, chunk_sizes, strict=True)]
    logits, captured = run_chunks(models.ours, chunks)
    for index, sequence in enumerate(sequences):
        assert_matches(logits[index], captured[index], reference_forward(models.reference, sequence))


def test_window_matters_for_these_sequences(models: Models, tmp_path: Path) -> None:
    # Negative control for the parity tests: the same weights with the window switched off must not match, so a
    # model that ignored the window (or applied it to the wrong layers) could not pass them.
    directory = tmp_path / "no-window"
    shutil.copytree(models.directory, directory)
    edit_config(directory, lambda config: config.update(sliding_window=10_000))
    sequence = token_ids(24, seed=2)
    logits, _ = run_chunks(load_target(directory), [[sequence]])
    assert (logits[0] - reference_forward(models.reference, sequence).logits).abs().max().item() > 100 * TOLERANCE


def test_capture_only_what_is_asked(models: Models) -> None:
    model = models.ours
    cache = make_cache(model)
    metadata = cache.plan([(SequenceKV(), 5)])
    with torch.no_grad():
        output = model(torch.tensor(token_ids(5, seed=6)), metadata, cache, capture=[model.config.num_layers])
    assert sorted(output.captured) == [model.config.num_layers]


def test_shared_tables_are_the_raw_checkpoint_tensors(models: Models) -> None:
    # A draft sharing the embedding gets the unscaled table (the sqrt(hidden) scale is applied inside the target).
    tensors = load_file(str(models.directory / "model.safetensors"))
    assert torch.equal(models.ours.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
    if models.ours.config.tie_word_embeddings:
        assert models.ours.lm_head.weight is models.ours.model.embed_tokens.weight
    else:
        assert torch.equal(models.ours.lm_head.weight, tensors["lm_head.weight"])


def edit_config(directory: Path, edit: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# A gemma-3-1b style config.json as transformers 4.x wrote it: sliding_window_pattern instead of layer_types, rope
# bases as top-level keys. head_dim, query_pre_attn_scalar, rms_norm_eps, max_position_embeddings, hidden_activation
# and tie_word_embeddings are left out, so transformers' defaults must be ours too.
LEGACY_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 50_000.0,
    "rope_local_base_freq": 1_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "eos_token_id": [1, 106],
}


def test_legacy_config_keys_translate_like_transformers() -> None:
    legacy = Gemma3Config.from_hf(LEGACY_CONFIG)
    assert legacy.sliding_layers == (True,) * 5 + (False,) + (True,) * 5 + (False,)
    assert legacy.global_rope == RopeConfig(theta=50_000.0, rope_type="linear", factor=8.0)
    assert legacy.local_rope == RopeConfig(theta=1_000.0)
    assert (legacy.head_dim, legacy.query_pre_attn_scalar, legacy.tie_word_embeddings) == (256, 256.0, True)
    assert legacy.eos_token_ids == (1, 106)
    # transformers' own reading of the same file, written back out in its current format, translates identically.
    hf_arguments = {key: value for key, value in LEGACY_CONFIG.items() if key != "architectures"}
    current = Gemma3TextConfig(**hf_arguments).to_dict() | {"architectures": LEGACY_CONFIG["architectures"]}
    assert "layer_types" in current and "rope_parameters" in current
    assert Gemma3Config.from_hf(current) == replace(legacy, torch_dtype=Gemma3Config.from_hf(current).torch_dtype)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["chunked_attention"] * 12}, "layer_types"),
        ({"layer_types": [LOCAL] * 11}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}, "rope_parameters"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_scaling"),
    ],
)
def test_unsupported_gemma3_variants_are_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        Gemma3Config.from_hf(LEGACY_CONFIG | changes)


def test_registry_dispatches_per_architecture() -> None:
    # Each family's default EAGLE3 capture set, for a draft that names no layers (REFERENCE.md).
    assert target_architecture("Gemma3ForCausalLM").default_capture_indices(26) == (2, 13, 24)
    assert target_architecture("LlamaForCausalLM").default_capture_indices(32) == (2, 16, 29)
    with pytest.raises(ConfigError, match=r"'PaliGemmaForConditionalGeneration' is not a supported target \(.*Gemma3"):
        target_architecture("PaliGemmaForConditionalGeneration")
