"""Our Gemma 4 text target on the paged KV cache against transformers 5.24's Gemma4ForCausalLM, on tiny random
checkpoints written by transformers' own classes and save_pretrained (tests.helpers.gemma4_checkpoints).

Two checkpoints: "dense" has per-layer input embeddings, full layers with their own head dim and K=V heads
(attention_k_eq_v, no v_proj), proportional rope turning half of the full layers' pairs, the last two layers
KV-shared (one sliding, one full: they read layers 3 and 2) with double-wide MLPs, and a strong final softcap;
"moe" has routed experts beside every dense MLP, full layers with v_proj and two KV heads, biases and an untied head.
Every layer's layer_scalar and every norm weight is random. The sliding window (8) is shorter than the sequences, so
the windows cut the context in prefill, in chunks over cached context and in single-token decodes; each capture
index is compared with transformers' residual stream there.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma4TextConfig

from tandem.layers.kv_cache import CacheLayout
from tandem.models.config import ConfigError, read_target_config
from tandem.models.gemma4 import Gemma4ForCausalLM
from tandem.models.gemma4_config import Gemma4Config
from tandem.models.registry import check_tensor_parallel, load_target
from tandem.parallel.group import ParallelismError
from tandem.parallel.vocab import assemble_shards
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.main import start_target
from target_server.settings import TargetSettings
from tests.helpers.gemma4_checkpoints import SPECS, write_tiny_gemma4
from tests.helpers.parity import TOLERANCE, assert_matches, reference_forward, run_chunks, split, token_ids
from tests.unit.test_tensor_parallel import CACHE as TP_CACHE
from tests.unit.test_tensor_parallel import scenario, scenario_at_tp2

CACHE = KVCacheSettings(num_blocks=64, block_size=4)
SLIDING, FULL = "sliding_attention", "full_attention"
NEW_TOKENS = 10


@dataclass(frozen=True)
class Models:
    directory: Path
    ours: Gemma4ForCausalLM
    reference: Any  # a transformers PreTrainedModel


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = write_tiny_gemma4(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(directory)
    assert isinstance(ours, Gemma4ForCausalLM)
    return Models(directory, ours, reference)


@pytest.mark.parametrize(
    "chunk_sizes",
    [
        [24],  # one prefill, 3 windows long
        [12, 1, 1, 5, 1, 4],  # prefill past the window, then decodes and chunks over a longer context
        [3, 4, 4, 1, 4, 1, 4, 1],  # the window is crossed inside a decode chunk
    ],
)
def test_prefill_then_decode_chunks_match_transformers(models: Models, chunk_sizes: list[int]) -> None:
    sequence = token_ids(sum(chunk_sizes), seed=2)
    logits, captured = run_chunks(models.ours, [split(sequence, chunk_sizes)])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, sequence))


def test_packed_batch_of_three_sequences(models: Models) -> None:
    # One packed forward per step: the KV-shared layers read each sequence's own rows of their store layer's cache.
    sequences = [token_ids(22, seed=3), token_ids(7, seed=4), token_ids(25, seed=5)]
    chunk_sizes = [[10, 1, 4, 7], [3, 1, 3], [12, 4, 1, 8]]
    chunks = [split(sequence, sizes) for sequence, sizes in zip(sequences, chunk_sizes, strict=True)]
    logits, captured = run_chunks(models.ours, chunks)
    for index, sequence in enumerate(sequences):
        assert_matches(logits[index], captured[index], reference_forward(models.reference, sequence))


def transformers_greedy(reference: Any, prompt: list[int], count: int) -> list[int]:
    with torch.no_grad():
        output = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=count, min_new_tokens=count, eos_token_id=None
        )
    return [int(token) for token in output[0, len(prompt) :]]


def served_greedy(model_dir: Path, prompt: list[int], count: int, dequantize: bool = False) -> list[int]:
    """Greedy decoding through the target server's runner (prefill, then one verify per token); `dequantize`: the
    target's --dequantize (quantized checkpoints)."""
    runner = start_target(TargetSettings(model_dir=model_dir, cache=CACHE, dequantize=dequantize))
    tokens = list(runner.prefill("plain", prompt, SamplingParams()).new_tokens)
    while len(tokens) < count:
        tokens += runner.verify("plain").new_tokens
    # Drafts: the next two greedy tokens and a wrong third are checked in one step over the cached context.
    runner.prefill("drafted", prompt, SamplingParams())
    drafted = runner.verify("drafted", [tokens[1], tokens[2], (tokens[3] + 1) % 300])
    assert (drafted.accepted, drafted.new_tokens) == (2, [tokens[1], tokens[2], tokens[3]])
    return tokens[:count]


def test_served_greedy_equals_transformers_generate(models: Models) -> None:
    prompt = token_ids(13, seed=7)
    expected = transformers_greedy(models.reference, prompt, NEW_TOKENS)
    assert served_greedy(models.directory, prompt, NEW_TOKENS) == expected


def edit_config(directory: Path, edit: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def without_partial_rotary(config: dict[str, Any]) -> None:
    config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 1.0


@pytest.mark.parametrize(
    "edit",
    [lambda config: config.update(sliding_window=10_000), without_partial_rotary],
    ids=["no-window", "whole-head-rotary"],
)
def test_window_and_partial_rotary_matter_here(models: Models, tmp_path: Path, edit: Any) -> None:
    # Negative controls for the parity tests: the same weights without the window, or with the full layers' rope
    # turning every pair, must not match, so a model that ignored either could not pass them.
    directory = tmp_path / "edited"
    shutil.copytree(models.directory, directory)
    edit_config(directory, edit)
    sequence = token_ids(24, seed=2)
    logits, _ = run_chunks(load_target(directory), [[sequence]])
    assert (logits[0] - reference_forward(models.reference, sequence).logits).abs().max().item() > 100 * TOLERANCE


def test_shapes_as_transformers_builds_them(models: Models) -> None:
    config = models.ours.config
    for index, layer in enumerate(models.reference.model.layers):
        attention, spec = layer.self_attn, config.layers[index]
        assert (spec.head_dim, spec.sliding) == (attention.head_dim, attention.is_sliding)
        assert spec.kv_source != index if attention.is_kv_shared_layer else spec.kv_source == index
        assert spec.intermediate_size == layer.mlp.intermediate_size
        if not attention.is_kv_shared_layer:
            assert spec.num_kv_heads * spec.head_dim == attention.k_proj.out_features
            assert spec.values_from_keys == (attention.v_proj is None)
    if models.directory.name.startswith("dense"):
        assert [spec.kv_source for spec in config.layers] == [0, 1, 2, 3, 3, 2]
    # Rows as wide as the widest layer's K heads: 2 x 32 on full layers (sliding ones use 2 x 16 of them).
    assert config.cache_layout == CacheLayout(num_kv_heads=1, key_dim=64, value_dim=64)
    assert models.ours.cache_layout == config.cache_layout


def hub_form(saved: dict[str, Any]) -> dict[str, Any]:
    """A transformers-saved config.json as the hub releases write it: global_head_dim and
    num_global_key_value_heads instead of per_layer_config."""
    full = next(iter(saved["per_layer_config"].values()))
    hub = {key: value for key, value in saved.items() if key != "per_layer_config"}
    hub["global_head_dim"] = full["head_dim"]
    hub["num_global_key_value_heads"] = full.get("num_key_value_heads", saved["num_key_value_heads"])
    return hub


def test_hub_config_keys_translate_like_transformers_save(models: Models) -> None:
    saved = read_target_config(models.directory)
    hub = hub_form(saved)
    assert Gemma4Config.from_hf(hub) == Gemma4Config.from_hf(saved)
    # transformers' own reading of the hub form, saved again, translates identically too.
    resaved = Gemma4TextConfig(**{key: value for key, value in hub.items() if key != "architectures"}).to_dict()
    assert Gemma4Config.from_hf(resaved | {"architectures": saved["architectures"]}) == Gemma4Config.from_hf(saved)


def test_global_kv_heads_apply_only_with_k_eq_v() -> None:
    # transformers reads num_global_key_value_heads only when attention_k_eq_v is set; so does the translation.
    hub: dict[str, Any] = {"num_hidden_layers": 2, "layer_types": [SLIDING, SLIDING], "num_key_value_heads": 4}
    hub |= {"global_head_dim": 64, "num_global_key_value_heads": 1}
    for k_eq_v, heads in ((True, 1), (False, 4)):
        config = Gemma4Config.from_hf(hub | {"attention_k_eq_v": k_eq_v, "architectures": ["Gemma4ForCausalLM"]})
        reference: Any = Gemma4TextConfig(**hub, attention_k_eq_v=k_eq_v)
        # transformers also turns the last layer into a full one.
        assert reference.layer_types == [SLIDING, FULL]
        assert [spec.sliding for spec in config.layers] == [True, False]
        full = reference.per_layer_config[1]
        assert (full.num_key_value_heads, full.head_dim) == (heads, 64)
        assert (config.layers[1].num_kv_heads, config.layers[1].head_dim) == (heads, 64)


def test_unknown_layer_type_is_refused_at_load(models: Models, tmp_path: Path) -> None:
    directory = tmp_path / "unknown-layer"
    shutil.copytree(models.directory, directory)
    edit_config(directory, lambda config: config["layer_types"].__setitem__(1, "chunked_attention"))
    with pytest.raises(ConfigError, match=r"^layer_types: \['chunked_attention'\] are not Gemma 4 layer types"):
        load_target(directory)


BASE = {"architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 2, "layer_types": [SLIDING, FULL]}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"per_layer_config": {"1": {"intermediate_size": 8}}}, "per_layer_config"),
        # Two sliding layers of different head dims: one rotary table per type cannot serve both.
        (
            {
                "num_hidden_layers": 3,
                "layer_types": [SLIDING, SLIDING, FULL],
                "per_layer_config": {"0": {"head_dim": 32}},
            },
            "per_layer_config",
        ),
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),  # no layer left to keep K/V
        # The shared sliding layer 1 has no earlier sliding layer to read.
        (
            {"num_hidden_layers": 3, "layer_types": [FULL, SLIDING, FULL], "num_kv_shared_layers": 2},
            "num_kv_shared_layers",
        ),
        ({"enable_moe_block": True, "num_experts": 4}, "top_k_experts"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ],
)
def test_unsupported_gemma4_variants_are_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        Gemma4Config.from_hf(BASE | changes)


def test_tensor_parallel_is_refused_naming_the_shape(models: Models, tmp_path: Path) -> None:
    check_tensor_parallel(models.directory, 2)  # 4 heads, 2 + 2 KV heads, 4 experts, even MLP widths
    with pytest.raises(ParallelismError, match="tp 4 does not divide num_key_value_heads 2"):
        check_tensor_parallel(models.directory, 4)
    # One KV head on the full layers (gemma-4-E2B has one on every layer) cannot be split in two.
    directory = tmp_path / "one-full-kv-head"
    shutil.copytree(models.directory, directory)
    edit_config(
        directory, lambda config: [layer.update(num_key_value_heads=1) for layer in config["per_layer_config"].values()]
    )
    with pytest.raises(ParallelismError, match="tp 2 does not divide the full layers' num_key_value_heads 1"):
        check_tensor_parallel(directory, 2)


@pytest.fixture(scope="module")
def results_at_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """tests.unit.test_tensor_parallel's scenario (packed steps with capture, greedy rounds, drafts, weight shards)
    at tp 2 for both checkpoints, run by one spawned rank 0 through the target server's start-up."""
    directories = {name: write_tiny_gemma4(tmp_path_factory.mktemp(f"tp-{name}"), spec) for name, spec in SPECS.items()}
    found = scenario_at_tp2(directories, tmp_path_factory.mktemp("tp2") / "scenario.pt")
    return {"directories": directories, **found}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp2_matches_tp1(results_at_tp2: dict[str, Any], name: str) -> None:
    directory = results_at_tp2["directories"][name]
    at_tp1, at_tp2 = scenario(start_target(TargetSettings(model_dir=directory, cache=TP_CACHE))), results_at_tp2[name]
    assert (at_tp2["logits"] - at_tp1["logits"]).abs().max().item() <= TOLERANCE
    assert (at_tp2["streams"] - at_tp1["streams"]).abs().max().item() <= TOLERANCE
    assert at_tp2["tokens"] == at_tp1["tokens"] and at_tp1["tokens"][-1][0] == 2
    assert (at_tp2["features"] - at_tp1["features"]).abs().max().item() <= TOLERANCE
    table = load_file(str(directory / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(assemble_shards(at_tp2["shards"]["embed_tokens"], table.shape[0]), table)
