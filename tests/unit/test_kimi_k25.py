"""Kimi-K2.5 served as a DeepSeek-V3 target, against transformers 5.24's Kimi_K25ForConditionalGeneration on
text-only input.

Tiny random checkpoints written by transformers' own classes and save_pretrained (tests.helpers.kimi_checkpoints), in
two layouts of the same weights: as transformers saves them (`language_model.model.blocks.*`) and as the release names
them (`language_model.model.layers.*`, KimiK25ForConditionalGeneration, text model_type kimi_k2). The target reads the
text_config and the language model only. Its EAGLE3-MLA heads' layer ids resolve to SGLang's capture points.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import Kimi_K25ForConditionalGeneration

from draft_server.formats import prepare_draft
from draft_server.settings import DraftSettings
from tandem.models.aux_layers import CaptureSpec
from tandem.models.config import ConfigError
from tandem.models.deepseek_v3 import KIMI_K25_NAMES, DeepseekV3Config, DeepseekV3ForCausalLM, kimi_k25_text_config
from tandem.models.registry import load_target
from tandem.wire import target_pb2
from tests.helpers.deepseek_checkpoints import TinyDeepseekSpec
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla
from tests.helpers.kimi_checkpoints import HUB_TOWERS, to_hub_layout, write_tiny_kimi_k25
from tests.helpers.parity import assert_matches, reference_forward, run_chunks, split, token_ids
from tests.unit.test_gemma4 import NEW_TOKENS, served_greedy, transformers_greedy

SPEC = TinyDeepseekSpec(num_layers=3, q_lora_rank=32, rope_interleave=True)
LAYOUTS = ("transformers", "hub")


@dataclass(frozen=True)
class Models:
    directory: Path
    ours: DeepseekV3ForCausalLM
    reference: Any  # transformers' Kimi_K25ForConditionalGeneration


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_kimi_k25(tmp_path_factory.mktemp("kimi-k25"), SPEC)


@pytest.fixture(scope="module", params=LAYOUTS)
def models(request: pytest.FixtureRequest, saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = saved
    if request.param == "hub":
        directory = to_hub_layout(shutil.copytree(saved, tmp_path_factory.mktemp("hub") / "kimi"))
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(directory)
    assert isinstance(ours, DeepseekV3ForCausalLM)
    return Models(directory, ours, reference)


def test_text_matches_transformers(models: Models) -> None:
    sequence = token_ids(20, seed=3)
    logits, captured = run_chunks(models.ours, [split(sequence, [11, 1, 4, 1, 3])])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, sequence))


def test_served_greedy_equals_transformers_generate(models: Models) -> None:
    prompt = token_ids(13, seed=7)
    expected = transformers_greedy(models.reference, prompt, NEW_TOKENS)
    assert served_greedy(models.directory, prompt, NEW_TOKENS) == expected


def test_layouts_and_architecture_names(saved: Path, models: Models) -> None:
    with safe_open(str(models.directory / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    layers = "blocks" if models.directory == saved else "layers"
    assert any(name.startswith(f"language_model.model.{layers}.1.mlp.experts.") for name in names)
    assert "language_model.lm_head.weight" in names
    expected = "Kimi_K25ForConditionalGeneration" if models.directory == saved else "KimiK25ForConditionalGeneration"
    assert models.ours.config.architecture == expected
    # Untied: the head is the checkpoint's own, not the embedding.
    assert not models.ours.config.tie_word_embeddings
    assert not torch.equal(models.ours.lm_head.weight, models.ours.model.embed_tokens.weight)


def test_vision_tower_is_not_read(models: Models, caplog: pytest.LogCaptureFixture) -> None:
    with safe_open(str(models.directory / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    towers = [name for name in names if not name.startswith("language_model.")]
    assert towers and all(name.startswith((*HUB_TOWERS, "model.mm_projector.")) for name in towers)
    with caplog.at_level(logging.INFO, logger="tandem.models.registry"):
        model = load_target(models.directory)
    assert isinstance(model, torch.nn.Module)
    assert "not used" not in caplog.text and "not reading" in caplog.text
    owned = dict(model.named_parameters()) | dict(model.named_buffers())
    mapped = {KIMI_K25_NAMES.to_parameter(name)[0] for name in names if name not in towers}
    assert mapped == set(owned)


def test_text_config_translation() -> None:
    hub: dict[str, Any] = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "eos_token_id": [2, 163586],  # with generation_config.json's (tandem.models.config.read_target_config)
        "tie_word_embeddings": False,
        "text_config": {"model_type": "kimi_k2", "hidden_size": 64, "eos_token_id": 2},
    }
    text = kimi_k25_text_config(hub)
    assert text["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert (text["eos_token_id"], text["tie_word_embeddings"], text["model_type"]) == ([2, 163586], False, "kimi_k2")
    # transformers' Kimi_K25Config ties the head when the top level says nothing.
    del hub["tie_word_embeddings"]
    assert kimi_k25_text_config(hub)["tie_word_embeddings"] is True
    with pytest.raises(ConfigError, match=r"^text_config: missing"):
        kimi_k25_text_config({"architectures": ["KimiK25ForConditionalGeneration"]})


def test_config_is_the_text_models(models: Models) -> None:
    hf = json.loads((models.directory / "config.json").read_text())
    assert models.ours.config == DeepseekV3Config.from_hf(kimi_k25_text_config(hf))
    assert models.ours.config.num_layers == SPEC.num_layers


# Kimi-K2.5 has 61 layers; its EAGLE3-MLA heads name [2, 30, 58], meant as layer inputs. SGLang's DeepSeek path
# adds 1 only when the first id is 1; an unconditional + 1 (its Llama path) would capture 3, 31, 59.
KIMI_K25_LAYERS = 61


@pytest.mark.parametrize(
    ("layer_ids", "convention", "expected"),
    [
        ((2, 30, 58), "input", (2, 30, 58)),  # the released heads
        ((1, 29, 57), "output", (2, 30, 58)),  # the same layers named as outputs
        (None, "default", (2, 30, 58)),  # no ids: the DeepSeek-V3 family's default set, warned about
    ],
)
def test_eagle3_mla_head_capture_points(
    models: Models,
    tmp_path: Path,
    layer_ids: tuple[int, ...] | None,
    convention: str,
    expected: tuple[int, ...],
) -> None:
    config = models.ours.config
    shapes = tmp_path / "target-shapes"  # what the head writer reads of its target
    shapes.mkdir()
    (shapes / "config.json").write_text(json.dumps({"vocab_size": config.vocab_size, "hidden_size": 64}))
    draft_dir = write_tiny_eagle3_mla(tmp_path / "head", shapes, TinyEagle3MLASpec(layer_ids=layer_ids))
    info = target_pb2.TargetInfo(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=KIMI_K25_LAYERS,
    )
    settings = DraftSettings(model_dir=draft_dir, target_address="", replica_id="r0")
    prepared = prepare_draft(settings, info)
    assert prepared.capture == CaptureSpec(expected, convention, layer_ids)
