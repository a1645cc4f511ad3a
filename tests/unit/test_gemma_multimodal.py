"""The multimodal Gemma checkpoints served as text targets, against transformers 5.24 on text-only input.

Gemma3ForConditionalGeneration and Gemma4ForConditionalGeneration checkpoints are written by transformers' own
classes and save_pretrained, with small vision (and, for Gemma 4, audio) towers. As saved, Gemma 3's language model is
under language_model.model.* with its own head at language_model.lm_head (untied here), Gemma 4's under
model.language_model.* with a tied head. The target must read the text_config and the language model's tensors only,
and compute what transformers' multimodal class computes for text (which, for Gemma 3, is its language model without
the final softcap: tandem.models.gemma3.multimodal_text_config).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from tandem.models.config import ConfigError, read_target_config
from tandem.models.gemma3 import MULTIMODAL_NAMES, Gemma3Config, Gemma3ForCausalLM, language_model_config
from tandem.models.gemma4 import Gemma4ForCausalLM
from tandem.models.gemma4_config import Gemma4Config
from tandem.models.registry import load_target, target_architecture
from tests.helpers.gemma4_checkpoints import SPECS, write_tiny_gemma3_multimodal, write_tiny_gemma4_multimodal
from tests.helpers.parity import assert_matches, reference_forward, run_chunks, split, token_ids
from tests.unit.test_gemma4 import NEW_TOKENS, served_greedy, transformers_greedy

WRITERS = {
    "gemma3": write_tiny_gemma3_multimodal,
    "gemma4": lambda directory: write_tiny_gemma4_multimodal(directory, SPECS["dense"]),
}


@dataclass(frozen=True)
class Models:
    directory: Path
    ours: Gemma3ForCausalLM | Gemma4ForCausalLM
    reference: Any  # a transformers PreTrainedModel


@pytest.fixture(scope="module", params=sorted(WRITERS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = WRITERS[request.param](tmp_path_factory.mktemp(request.param))
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(directory)
    assert isinstance(ours, Gemma3ForCausalLM | Gemma4ForCausalLM)
    return Models(directory, ours, reference)


def test_text_matches_transformers_multimodal_class(models: Models) -> None:
    sequence = token_ids(24, seed=2)
    logits, captured = run_chunks(models.ours, [split(sequence, [12, 1, 1, 5, 1, 4])])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, sequence))


def test_served_greedy_equals_transformers_generate(models: Models) -> None:
    prompt = token_ids(13, seed=7)
    expected = transformers_greedy(models.reference, prompt, NEW_TOKENS)
    assert served_greedy(models.directory, prompt, NEW_TOKENS) == expected


def test_towers_are_not_read(models: Models, caplog: pytest.LogCaptureFixture) -> None:
    with safe_open(str(models.directory / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    towers = [name for name in names if "language_model" not in name]
    assert any("vision_tower" in name for name in towers)
    with caplog.at_level(logging.INFO, logger="tandem.models.registry"):
        model = load_target(models.directory)
    assert isinstance(model, torch.nn.Module)
    # Every tensor the target does not read is a tower's: none is reported as unused, and the model has no
    # parameter beyond the language model's.
    assert "not used" not in caplog.text and "not reading" in caplog.text
    assert not any(word in name for name, _ in model.named_parameters() for word in ("vision", "audio", "projector"))
    # Every language-model tensor has its parameter (loading also fails on any parameter left without a tensor).
    owned = dict(model.named_parameters()) | dict(model.named_buffers())
    mapped = [MULTIMODAL_NAMES.to_parameter(name)[0] for name in names if name not in towers]
    assert all(name in owned for name in mapped) and len(mapped) == len(names) - len(towers) > 0


def test_text_config_translation() -> None:
    multimodal: dict[str, Any] = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],  # top level, and generation_config.json's (read_target_config adds them here)
        "tie_word_embeddings": False,
        "text_config": {"hidden_size": 64, "num_hidden_layers": 2, "eos_token_id": 1, "tie_word_embeddings": True},
    }
    text = language_model_config(multimodal)
    assert text["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert (text["eos_token_id"], text["tie_word_embeddings"]) == ([1, 106], False)
    config = Gemma3Config.from_hf(text)
    # What the text_config leaves out is transformers' Gemma3TextConfig default (the 4B+ releases leave most out).
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim) == (262_208, 8, 4, 256)
    with pytest.raises(ConfigError, match=r"^text_config: missing"):
        language_model_config({"architectures": ["Gemma4ForConditionalGeneration"]})


def test_text_config_is_read_as_the_text_models_config(models: Models) -> None:
    hf = read_target_config(models.directory)
    text = hf["text_config"] | {
        "architectures": hf["architectures"],
        "eos_token_id": [2],
        "tie_word_embeddings": hf["tie_word_embeddings"],
    }
    if isinstance(models.ours, Gemma4ForCausalLM):
        assert models.ours.config == Gemma4Config.from_hf(text)
    else:  # Gemma 3's multimodal head applies no final softcap
        assert text["final_logit_softcapping"] is not None
        assert models.ours.config == Gemma3Config.from_hf(text | {"final_logit_softcapping": None})


def test_both_multimodal_classes_are_targets() -> None:
    for name in ("Gemma3ForConditionalGeneration", "Gemma4ForConditionalGeneration"):
        assert target_architecture(name).default_capture_indices(26) == (2, 13, 24)
