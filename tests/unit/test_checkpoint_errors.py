"""Checkpoints and configs that do not fit are refused with a message naming the tensor or field and the values."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.models.config import ConfigError, ModelConfig
from tandem.models.eagle3 import load_eagle3
from tandem.models.registry import load_target
from tandem.weights.loader import CheckpointError
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target


@pytest.fixture(scope="module")
def pristine_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture
def target_dir(pristine_target: Path, tmp_path: Path) -> Path:
    """A private copy of the target, so that a test may break it."""
    return Path(shutil.copytree(pristine_target, tmp_path / "target"))


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_pristine_target_loads(target_dir: Path) -> None:
    # The baseline for every test below: the unedited checkpoint is accepted.
    assert load_target(target_dir).config.num_layers == 4


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        # Parts of packed parameters are named as the checkpoint names them, not by our packed name.
        "model.layers.2.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ],
)
def test_missing_tensor_is_named(target_dir: Path, tensor: str) -> None:
    edit_tensors(target_dir, lambda tensors: tensors.pop(tensor))
    with pytest.raises(CheckpointError) as error:
        load_target(target_dir)
    assert f"missing tensor {tensor} in {target_dir}" in str(error.value)


@pytest.mark.parametrize(
    ("tensor", "wrong_shape", "expected_shape"),
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 32), (64, 64)),
        ("model.layers.3.self_attn.q_proj.weight", (60, 64), (64, 64)),  # a packed part
        ("model.embed_tokens.weight", (300, 64), (320, 64)),
    ],
)
def test_wrong_shape_names_tensor_and_both_shapes(
    target_dir: Path, tensor: str, wrong_shape: tuple[int, ...], expected_shape: tuple[int, ...]
) -> None:
    edit_tensors(target_dir, lambda tensors: tensors.update({tensor: torch.zeros(wrong_shape)}))
    with pytest.raises(CheckpointError) as error:
        load_target(target_dir)
    message = str(error.value)
    assert tensor in message
    assert f"expected shape {expected_shape}, got {wrong_shape}" in message


def test_unknown_architecture(target_dir: Path) -> None:
    edit_config(target_dir, lambda config: config.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match=r"architectures: 'GPT2LMHeadModel' is not a supported target"):
        load_target(target_dir)


def test_missing_architectures(target_dir: Path) -> None:
    edit_config(target_dir, lambda config: config.pop("architectures"))
    with pytest.raises(ConfigError, match="architectures: missing"):
        load_target(target_dir)


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_config_field_is_named(target_dir: Path, field: str) -> None:
    edit_config(target_dir, lambda config: config.pop(field))
    with pytest.raises(ConfigError, match=f"^{field}: missing from config.json"):
        load_target(target_dir)


def test_unsupported_rope_type_is_named(target_dir: Path) -> None:
    edit_config(target_dir, lambda config: config.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}))
    with pytest.raises(ConfigError, match="rope_type: 'dynamic' is not supported"):
        load_target(target_dir)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json: not found"):
        load_target(tmp_path)


def test_no_weight_files(target_dir: Path) -> None:
    (target_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_target(target_dir)


# EAGLE3 heads.


@pytest.fixture
def draft_dir(pristine_target: Path, tmp_path: Path) -> Path:
    return write_tiny_eagle3(tmp_path / "draft", pristine_target, TinyEagle3Spec(draft_vocab_size=32))


def test_pristine_draft_loads(draft_dir: Path) -> None:
    model, has_embedding = load_eagle3(draft_dir)
    assert model.config.draft_vocab_size == 32
    assert not has_embedding


def test_eagle3_wrong_architecture(draft_dir: Path) -> None:
    edit_config(draft_dir, lambda config: config.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match=r"architectures: 'LlamaForCausalLM' is not an EAGLE3 head"):
        load_eagle3(draft_dir)


def test_eagle3_more_than_one_layer(draft_dir: Path) -> None:
    edit_config(draft_dir, lambda config: config.update(num_hidden_layers=2))
    with pytest.raises(ConfigError, match="num_hidden_layers: EAGLE3 heads have 1 layer, got 2"):
        load_eagle3(draft_dir)


@pytest.mark.parametrize(
    ("spec", "tensor"),
    [
        (TinyEagle3Spec(), "midlayer.hidden_norm.weight"),
        (TinyEagle3Spec(), "midlayer.self_attn.v_proj.weight"),
        # Named in the spelling this checkpoint uses, although several spellings load into the same parameter.
        (TinyEagle3Spec(weight_prefix="layers.0"), "layers.0.hidden_norm.weight"),
        (TinyEagle3Spec(weight_prefix="layers.0"), "layers.0.self_attn.q_proj.weight"),
        (TinyEagle3Spec(fc_norm=True), "fc_norm.1.weight"),
        (TinyEagle3Spec(fc_norm=True, legacy_aux_norm_names=True), "aux_norm_mid.weight"),
        (TinyEagle3Spec(), "fc.weight"),
    ],
)
def test_eagle3_missing_tensor_is_named(
    pristine_target: Path, tmp_path: Path, spec: TinyEagle3Spec, tensor: str
) -> None:
    draft_dir = write_tiny_eagle3(tmp_path, pristine_target, spec)
    edit_tensors(draft_dir, lambda tensors: tensors.pop(tensor))
    with pytest.raises(CheckpointError) as error:
        load_eagle3(draft_dir)
    assert str(error.value) == f"missing tensor {tensor} in {draft_dir}"


def test_eagle3_reduced_vocab_needs_d2t(draft_dir: Path) -> None:
    edit_tensors(draft_dir, lambda tensors: tensors.pop("d2t"))
    with pytest.raises(CheckpointError, match="missing tensor d2t"):
        load_eagle3(draft_dir)


def test_eagle3_fc_wrong_width(draft_dir: Path) -> None:
    # fc must take num_aux * target_hidden inputs: 3 * 64 = 192.
    edit_tensors(draft_dir, lambda tensors: tensors.update({"fc.weight": torch.zeros(64, 128)}))
    with pytest.raises(CheckpointError, match=r"fc\.weight .*expected shape \(64, 192\), got \(64, 128\)"):
        load_eagle3(draft_dir)


def test_d2t_reaching_the_last_target_id_is_accepted(pristine_target: Path, tmp_path: Path) -> None:
    write_tiny_eagle3(tmp_path, pristine_target, TinyEagle3Spec(d2t=[0, 1, 2, 316]))
    model, _ = load_eagle3(tmp_path)
    assert model.to_target_ids(torch.arange(4)).tolist() == [0, 2, 4, 319]


@pytest.mark.parametrize(
    ("offsets", "shown_range"),
    [
        ([0, 1, 2, 317], "0..320"),  # draft id 3 -> target id 320, one past the vocabulary
        ([-1, 1, 2, 3], "-1..6"),  # draft id 0 -> target id -1
    ],
)
def test_d2t_outside_the_target_vocab(
    pristine_target: Path, tmp_path: Path, offsets: list[int], shown_range: str
) -> None:
    write_tiny_eagle3(tmp_path, pristine_target, TinyEagle3Spec(d2t=offsets))
    with pytest.raises(ConfigError) as error:
        load_eagle3(tmp_path)
    message = str(error.value)
    assert message.startswith("d2t: ")
    assert f"target ids {shown_range}" in message
    assert "outside the target vocabulary 0..319" in message


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 64, "max_position_embeddings": 512}, "sliding_window"),
    ],
)
def test_unsupported_llama_variants_are_refused(changes: dict[str, object], field: str) -> None:
    hf = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **changes,
    }
    with pytest.raises(ConfigError, match=f"^{field}:"):
        ModelConfig.from_hf(hf)
