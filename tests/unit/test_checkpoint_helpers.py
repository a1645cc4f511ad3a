"""The tiny checkpoint writers produce what transformers and the EAGLE3 format expect."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests.helpers.checkpoints import (
    FAMILY_CLASSES,
    TargetFamily,
    TinyEagle3Spec,
    TinyTargetSpec,
    d2t_offsets,
    target_ids_of_draft,
    write_tiny_eagle3,
    write_tiny_target,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
PROMPT = torch.tensor([[1, 40, 41, 42, 43, 44]])  # [batch, sequence]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(rope_scaling=LLAMA3_ROPE))


def prompt_logits(directory: Path) -> torch.Tensor:  # [sequence, vocab]
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(PROMPT).logits[0]


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in load_file(directory / "model.safetensors").items()}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_target_loads_back_with_transformers(tmp_path: Path, family: TargetFamily) -> None:
    write_tiny_target(tmp_path, TinyTargetSpec(family=family))

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(model) is FAMILY_CLASSES[family][1]
    assert model.dtype == torch.float32
    assert (model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers) == (320, 64, 4)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 2
    parameter_names = {name for name, _ in model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in parameter_names) == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in parameter_names) == (family == "qwen3")

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 320
    text = "def add(value: int) -> int:\n    return value + 1"
    token_ids = tokenizer(text).input_ids
    assert max(token_ids) < 320
    assert tokenizer.decode(token_ids) == text


def test_target_logits_are_spread_out_and_seeded(tmp_path: Path) -> None:
    torch.manual_seed(5)
    write_tiny_target(tmp_path / "first", TinyTargetSpec())
    # The helper must not consume the global RNG: the caller's random stream is the same as without it.
    after_write = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after_write, torch.rand(4))

    logits = prompt_logits(tmp_path / "first")
    same_seed = prompt_logits(write_tiny_target(tmp_path / "again", TinyTargetSpec()))
    other_seed = prompt_logits(write_tiny_target(tmp_path / "other", TinyTargetSpec(seed=1)))

    # transformers' default init (std 0.02) gives a logit spread near 0.15; the helper's scale is several times that.
    assert logits.std(dim=-1).min() > 0.4
    assert torch.equal(logits, same_seed)
    assert not torch.allclose(logits, other_seed)


def test_sharded_target_has_index_and_same_weights(tmp_path: Path) -> None:
    write_tiny_target(tmp_path / "sharded", TinyTargetSpec(sharded=True))
    write_tiny_target(tmp_path / "single", TinyTargetSpec())

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) >= 3
    assert all((tmp_path / "sharded" / name).is_file() for name in shard_files)
    assert set(index["weight_map"]) == set(load_file(tmp_path / "single" / "model.safetensors"))
    assert torch.equal(prompt_logits(tmp_path / "sharded"), prompt_logits(tmp_path / "single"))


def test_zero_final_norm_makes_every_logit_zero(tmp_path: Path) -> None:
    logits = prompt_logits(write_tiny_target(tmp_path, TinyTargetSpec(family="qwen3", zero_final_norm=True)))
    assert torch.equal(logits, torch.zeros_like(logits))


def test_tied_target_stores_no_lm_head(tmp_path: Path) -> None:
    write_tiny_target(tmp_path, TinyTargetSpec(tie_word_embeddings=True))
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_target_rope_scaling_reaches_transformers(target_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert model.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 10000.0}


def expected_eagle3_shapes(
    prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, draft_vocab: int, target_hidden: int = 64
) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
        f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{prefix}.mlp.gate_proj.weight": (128, hidden),
        f"{prefix}.mlp.up_proj.weight": (128, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, 128),
        f"{prefix}.input_layernorm.weight": (hidden,),
        f"{prefix}.hidden_norm.weight": (hidden,),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
        "fc.weight": (hidden, 3 * target_hidden),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
        "d2t": (draft_vocab,),
        "t2d": (320,),
    }


def test_default_eagle3_head_matches_the_format(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir)

    assert tensor_shapes(tmp_path) == expected_eagle3_shapes("midlayer", 64, 4, 2, 16, 320)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.float32
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, 320, 320)
    assert (config["rope_theta"], config["rope_scaling"]) == (10000.0, LLAMA3_ROPE)
    assert config["tie_word_embeddings"] is False
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "norm_before_fc": False}
    absent_keys = {"target_hidden_size", "num_aux_hidden_states", "eagle_aux_hidden_state_layer_ids", "fc_norm"}
    assert absent_keys.isdisjoint(config)
    assert "norm_output" not in config


def test_eagle3_layers_prefix_with_fc_norm(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(weight_prefix="layers.0", fc_norm=True, norm_output=True))

    norms = {f"fc_norm.{index}.weight": (64,) for index in range(3)}
    assert tensor_shapes(tmp_path) == expected_eagle3_shapes("layers.0", 64, 4, 2, 16, 320) | norms
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"]) == (True, True)


def test_eagle3_legacy_aux_norm_names(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(fc_norm=True, legacy_aux_norm_names=True))

    norms = {f"aux_norm_{level}.weight": (64,) for level in ("low", "mid", "high")}
    assert tensor_shapes(tmp_path) == expected_eagle3_shapes("midlayer", 64, 4, 2, 16, 320) | norms
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["use_aux_norm"] is True
    assert "fc_norm" not in config


def test_eagle3_norm_before_fc_and_embedding(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(norm_before_fc=True, include_embedding=True))

    extra = {"norm_before_fc.weight": (192,), "embed_tokens.weight": (320, 64)}
    assert tensor_shapes(tmp_path) == expected_eagle3_shapes("midlayer", 64, 4, 2, 16, 320) | extra
    embedding = load_file(tmp_path / "model.safetensors")["embed_tokens.weight"]
    target_model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert torch.equal(embedding, target_model.model.embed_tokens.weight)
    assert json.loads((tmp_path / "config.json").read_text())["eagle_config"]["norm_before_fc"] is True


def test_eagle3_with_its_own_hidden_size(tmp_path: Path, target_dir: Path) -> None:
    spec = TinyEagle3Spec(hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=8, draft_vocab_size=50)
    write_tiny_eagle3(tmp_path, target_dir, spec)

    assert tensor_shapes(tmp_path) == expected_eagle3_shapes("midlayer", 96, 6, 3, 8, 50, target_hidden=64)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["hidden_size"], config["target_hidden_size"], config["head_dim"]) == (96, 64, 8)


@pytest.mark.parametrize("location", ["eagle_config", "top_level"])
def test_eagle3_layer_ids_location(
    tmp_path: Path, target_dir: Path, location: Literal["eagle_config", "top_level"]
) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(layer_ids=(1, 2), layer_ids_location=location))

    config = json.loads((tmp_path / "config.json").read_text())
    holder = config["eagle_config"] if location == "eagle_config" else config
    other = config if location == "eagle_config" else config["eagle_config"]
    assert holder["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    assert "eagle_aux_hidden_state_layer_ids" not in other
    assert "num_aux_hidden_states" not in config
    assert tensor_shapes(tmp_path)["fc.weight"] == (64, 2 * 64)


def test_eagle3_explicit_num_aux_is_written(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(num_aux=4, fc_norm=True))

    assert json.loads((tmp_path / "config.json").read_text())["num_aux_hidden_states"] == 4
    shapes = tensor_shapes(tmp_path)
    assert shapes["fc.weight"] == (64, 4 * 64)
    assert [name for name in shapes if name.startswith("fc_norm.")] == [f"fc_norm.{index}.weight" for index in range(4)]


def test_default_d2t_is_a_sorted_subset_with_id_zero(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(draft_vocab_size=100))

    target_ids = target_ids_of_draft(tmp_path)
    assert len(target_ids) == 100
    assert target_ids == sorted(set(target_ids))
    assert target_ids[0] == 0
    assert all(0 <= target_id < 320 for target_id in target_ids)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["d2t"][0] == 0
    assert tensors["t2d"].nonzero().flatten().tolist() == target_ids


def test_full_vocab_draft_has_zero_offsets(tmp_path: Path, target_dir: Path) -> None:
    write_tiny_eagle3(tmp_path, target_dir)

    assert target_ids_of_draft(tmp_path) == list(range(320))
    assert bool(load_file(tmp_path / "model.safetensors")["t2d"].all())


def test_explicit_d2t_is_written_as_given(tmp_path: Path, target_dir: Path) -> None:
    draft_to_target = [7, 3, 250, 11]
    write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(d2t=d2t_offsets(draft_to_target), zero_final_norm=True))

    assert target_ids_of_draft(tmp_path) == draft_to_target
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["d2t"].tolist() == [7, 2, 248, 8]
    assert tensors["lm_head.weight"].shape == (4, 64)
    assert torch.equal(tensors["norm.weight"], torch.zeros(64))
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 4


def test_eagle3_weights_are_seeded(tmp_path: Path, target_dir: Path) -> None:
    heads = {
        name: write_tiny_eagle3(tmp_path / name, target_dir, TinyEagle3Spec(draft_vocab_size=64, seed=seed))
        for name, seed in (("first", 0), ("again", 0), ("other", 1))
    }
    first, again, other = (load_file(directory / "model.safetensors") for directory in heads.values())

    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["fc.weight"], other["fc.weight"])
    assert not torch.equal(first["d2t"], other["d2t"])


@pytest.mark.parametrize(
    "spec",
    [
        TinyEagle3Spec(legacy_aux_norm_names=True),
        TinyEagle3Spec(fc_norm=True, legacy_aux_norm_names=True, num_aux=2),
        TinyEagle3Spec(layer_ids=(1, 2, 3), num_aux=4),
        TinyEagle3Spec(d2t=[0, 0], draft_vocab_size=3),
        TinyEagle3Spec(draft_vocab_size=321),
    ],
)
def test_inconsistent_eagle3_specs_are_refused(tmp_path: Path, target_dir: Path, spec: TinyEagle3Spec) -> None:
    with pytest.raises(ValueError):
        write_tiny_eagle3(tmp_path, target_dir, spec)
