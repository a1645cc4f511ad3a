"""Our Step-3.5 target against transformers' Step3p7 text model, on tiny random checkpoints of both kinds.

One set of weights, two checkpoints:
- "step3p7": Step3p7ForConditionalGeneration built by transformers from the legacy config below and written by its
  own save_pretrained (text_config, trimmed lists, per_layer_config, the hub tensor layout, a vision tower);
- "step3p5-hub": the hub's text-only Step3p5ForCausalLM layout, which transformers has no class for, so it is
  written here by hand: LEGACY_CONFIG as config.json, and the text model's tensors of the same checkpoint.
Both also hold two MTP layers after the last layer, as the hub stores them (REFERENCE.md, "MTP heads"): layer 4 a
dense decoder layer plus enorm, hnorm, eh_proj and shared_head.norm, layer 5 the same with its block weights under
`.transformer.` and its own shared_head.output. transformers ignores them, and so must we.

The config exercises every Step-3.5 feature: sliding layers (window 8, shorter than the sequences) with 6 query heads
and rope theta 1000 turning half of each head, full layers with 4 query heads and theta 50000 turning all of it; a
dense first layer then MoE layers of 8 stacked experts, 2 per token, with a router bias and scaling factor 2.5; clamps
that bite on the routed experts (layer 3), the shared expert (layer 3) and the dense MLP (layer 0). Negative controls
check that each of them changes the output, so the parity tests could not pass with one missing.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, Step3p7Config, Step3p7ForConditionalGeneration, Step3p7TextConfig

from tandem.layers.kv_cache import SequenceKV
from tandem.layers.matmul import ONEDNN, prepack
from tandem.models.config import ConfigError
from tandem.models.registry import check_tensor_parallel, load_target
from tandem.models.step3p5 import Step3p5DecoderLayer, Step3p5ForCausalLM
from tandem.models.step3p5_config import Step3p5Config
from tandem.models.step3p5_moe import Step3p5Experts
from tandem.parallel.group import ParallelismError
from target_server.main import start_target
from target_server.settings import TargetSettings
from tests.helpers.checkpoints import redraw_parameters
from tests.helpers.mtp_checkpoints import mtp_own_tensors
from tests.helpers.parity import (
    TOLERANCE,
    assert_matches,
    make_cache,
    reference_forward,
    run_chunks,
    split,
    token_ids,
)
from tests.unit.test_tensor_parallel import CACHE, max_difference, scenario, scenario_at_tp2

SLIDING, FULL = "sliding_attention", "full_attention"
NUM_LAYERS, NUM_MTP, HIDDEN, VOCAB = 4, 2, 64, 320
# The hub's legacy layout: per-layer lists padded with the MTP layers' entries, aliases, moe_layers_enum and
# attention_other_setting. A limit of 0 means no clamp, as on the hub.
LEGACY_CONFIG: dict[str, Any] = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_attention_groups": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "share_expert_dim": 48,
    "moe_layers_enum": "1,2,3",
    "moe_router_scaling_factor": 2.5,
    "sliding_window": 8,
    "layer_types": [SLIDING, FULL, SLIDING, FULL, SLIDING, SLIDING],
    "attention_other_setting": {"attention_type": SLIDING, "num_attention_heads": 6, "num_attention_groups": 2},
    "rope_theta": [1000.0, 50000.0, 1000.0, 50000.0, 1000.0, 1000.0],
    "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0, 0.5, 0.5],
    "swiglu_limits": [0, 7.0, 0, 0.4, 0, 0],
    "swiglu_limits_shared": [1.0, 0, 16.0, 0.3, 0, 0],
    "num_nextn_predict_layers": NUM_MTP,
    "use_head_wise_attn_gate": True,
    "moe_router_activation": "sigmoid",
    "use_moe_router_bias": True,
    "norm_expert_weight": True,
    "yarn_only_types": [FULL],
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
VISION_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# Router weights large enough that sigmoid scores spread over (0, 1), and a bias that changes some choices; the
# router test checks that no decision of this data is a near-tie (see tests/unit/test_deepseek_v3.py).
ROUTER_WEIGHT_STD, ROUTER_BIAS_STD = 0.2, 0.1
MIN_ROUTING_MARGIN = 1e-4
KINDS = ("step3p5-hub", "step3p7")


def write_step3p7(directory: Path, legacy_config: dict[str, Any] = LEGACY_CONFIG) -> None:
    """transformers' model from its own reading of a legacy config, with redrawn weights, written by save_pretrained."""
    legacy = {key: value for key, value in legacy_config.items() if key not in ("architectures", "model_type")}
    config = Step3p7Config(text_config=Step3p7TextConfig(**legacy).to_dict(), vision_config=VISION_CONFIG)
    with torch.random.fork_rng(devices=[]):
        model = Step3p7ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(0)
    redraw_parameters(model, generator, norm_center=0.0, stds={"mlp.gate.weight": ROUTER_WEIGHT_STD})
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * ROUTER_BIAS_STD)
    model.save_pretrained(directory)
    add_mtp_layers(directory, generator)


def add_mtp_layers(directory: Path, generator: torch.Generator) -> None:
    """Layers 4 and 5 as the hub stores MTP layers: a dense layer's tensors (layer 0's, redrawn) plus their own."""
    tensors = load_file(str(directory / "model.safetensors"))
    layer_0 = {name[len("model.layers.0.") :]: t for name, t in tensors.items() if name.startswith("model.layers.0.")}
    for index, block in ((NUM_LAYERS, ""), (NUM_LAYERS + 1, "transformer.")):
        prefix = f"model.layers.{index}."
        tensors |= {prefix + block + name: torch.randn(t.shape, generator=generator) for name, t in layer_0.items()}
        tensors |= mtp_own_tensors(prefix, HIDDEN, generator)
    tensors[f"model.layers.{NUM_LAYERS + 1}.shared_head.output.weight"] = torch.randn(
        VOCAB, HIDDEN, generator=generator
    )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_hub_layout(directory: Path, step3p7_dir: Path) -> Path:
    """Step3p5ForCausalLM as the hub ships it: LEGACY_CONFIG and the text model's tensors (vision tower left out)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(step3p7_dir / "model.safetensors"))
    text = {name: t for name, t in tensors.items() if name.startswith(("model.", "lm_head."))}
    assert len(text) < len(tensors), "the Step3p7 checkpoint has vision tensors to leave out"
    save_file(text, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(LEGACY_CONFIG, indent=2))
    return directory


@dataclass(frozen=True)
class Checkpoints:
    directories: dict[str, Path]
    reference: PreTrainedModel


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    step3p7_dir = tmp_path_factory.mktemp("step3p7")
    write_step3p7(step3p7_dir)
    hub_dir = write_hub_layout(tmp_path_factory.mktemp("step3p5-hub"), step3p7_dir)
    # The reference reads the checkpoint back, MTP tensors included, as a user of transformers would.
    reference = Step3p7ForConditionalGeneration.from_pretrained(step3p7_dir, dtype=torch.float32).eval()
    return Checkpoints({"step3p7": step3p7_dir, "step3p5-hub": hub_dir}, reference)


@pytest.fixture(scope="module")
def models(checkpoints: Checkpoints) -> dict[str, Step3p5ForCausalLM]:
    loaded = {kind: load_target(directory) for kind, directory in checkpoints.directories.items()}
    assert all(isinstance(model, Step3p5ForCausalLM) for model in loaded.values())
    return loaded  # type: ignore[return-value]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_sizes", [[22], [12, 1, 1, 5, 1, 4], [3, 4, 4, 1, 4, 1, 4, 1]])
def test_prefill_then_decode_chunks_match_transformers(
    checkpoints: Checkpoints, models: dict[str, Step3p5ForCausalLM], kind: str, chunk_sizes: list[int]
) -> None:
    sequence = token_ids(sum(chunk_sizes), seed=2)
    logits, captured = run_chunks(models[kind], [split(sequence, chunk_sizes)])
    assert_matches(logits[0], captured[0], reference_forward(checkpoints.reference, sequence))


def test_packed_batch_of_three_sequences(checkpoints: Checkpoints, models: dict[str, Step3p5ForCausalLM]) -> None:
    sequences = [token_ids(22, seed=3), token_ids(7, seed=4), token_ids(25, seed=5)]
    chunk_sizes = [[10, 1, 4, 7], [3, 1, 3], [12, 4, 1, 8]]
    chunks = [split(sequence, sizes) for sequence, sizes in zip(sequences, chunk_sizes, strict=True)]
    logits, captured = run_chunks(models["step3p5-hub"], chunks)
    for index, sequence in enumerate(sequences):
        assert_matches(logits[index], captured[index], reference_forward(checkpoints.reference, sequence))


def greedy_tokens(model: Step3p5ForCausalLM, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy decoding on the paged KV cache: one prefill, then one token per step."""
    cache, sequence = make_cache(model), SequenceKV()
    tokens, step_input = list(prompt), list(prompt)
    for _ in range(new_tokens):
        metadata = cache.plan([(sequence, len(step_input))])
        with torch.no_grad():
            output = model(torch.tensor(step_input), metadata, cache)
            logits = model.compute_logits(output.normed[-1:])
        step_input = [int(logits.argmax())]
        tokens += step_input
    return tokens[len(prompt) :]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_equals_transformers_generate(
    checkpoints: Checkpoints, models: dict[str, Step3p5ForCausalLM], kind: str
) -> None:
    prompt, new_tokens = token_ids(6, seed=11), 16  # past the sliding window of 8
    reference: Any = checkpoints.reference  # transformers' generate is not typed
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens, eos_token_id=None
        )
    expected = generated[0, len(prompt) :].tolist()
    assert greedy_tokens(models[kind], prompt, new_tokens) == expected
    assert len(set(expected)) > 3, "the test model should not just repeat one token"


def test_router_chooses_the_experts_transformers_chooses(
    checkpoints: Checkpoints, models: dict[str, Step3p5ForCausalLM]
) -> None:
    calls: list[tuple[int, torch.Tensor, Any]] = []  # (layer, router input, transformers' output)
    handles = []
    for index, layer in enumerate(checkpoints.reference.model.language_model.layers):
        if hasattr(layer.mlp, "gate"):
            hook = (lambda i: lambda module, inputs, output: calls.append((i, inputs[0], output)))(index)
            handles.append(layer.mlp.gate.register_forward_hook(hook))
    try:
        with torch.no_grad():
            checkpoints.reference(torch.tensor([token_ids(24, seed=7)]))
    finally:
        for handle in handles:
            handle.remove()
    assert [index for index, _, _ in calls] == [1, 2, 3]
    bias_changes_a_choice = False
    for index, hidden, (logits, weights, experts) in calls:
        moe = models["step3p5-hub"].model.layers[index].moe
        assert isinstance(moe, Step3p5Experts)
        choice = (logits.sigmoid() + moe.router_bias).sort(dim=-1, descending=True).values
        margin = (choice[:, 1] - choice[:, 2]).min().item()
        assert margin > MIN_ROUTING_MARGIN, f"layer {index}: near-tie in the test data ({margin:.2e})"
        with torch.no_grad():
            ours_experts, ours_weights = moe.route(hidden.reshape(-1, HIDDEN))
        ours_order, reference_order = ours_experts.sort(dim=-1), experts.sort(dim=-1)
        assert torch.equal(ours_order.values, reference_order.values), f"layer {index}"
        difference = ours_weights.gather(1, ours_order.indices) - weights.gather(1, reference_order.indices)
        assert difference.abs().max().item() <= 1e-6
        plain = logits.sigmoid().topk(2, dim=-1).indices.sort(dim=-1).values
        bias_changes_a_choice |= not torch.equal(plain, reference_order.values)
    assert bias_changes_a_choice


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=lambda scaling: scaling["rope_type"],
)
def test_rope_scaling_of_partial_rotary_full_layers_matches_transformers(
    tmp_path: Path, scaling: dict[str, Any]
) -> None:
    # The legacy rope_scaling applies to the full layers only; here they turn half of each head (the sliding ones
    # all of it), so the scaled frequencies are those of the rotated dimensions, as transformers computes them.
    legacy = LEGACY_CONFIG | {"rope_scaling": scaling, "partial_rotary_factors": [1.0, 0.5, 1.0, 0.5, 1.0, 1.0]}
    write_step3p7(tmp_path, legacy)
    reference = Step3p7ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reference.config.text_config.rope_parameters[FULL]["rope_type"] == scaling["rope_type"]
    sequence = token_ids(22, seed=2)
    logits, captured = run_chunks(load_target(tmp_path), [split(sequence, [12, 1, 9])])
    assert_matches(logits[0], captured[0], reference_forward(reference, sequence))
    # Negative control: the same checkpoint without the scaling must not match.
    edit_config(tmp_path, lambda config: config["text_config"]["rope_parameters"][FULL].update(rope_type="default"))
    unscaled, _ = run_chunks(load_target(tmp_path), [[sequence]])
    assert (unscaled[0] - logits[0]).abs().max().item() > 100 * TOLERANCE


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def no_limits(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.update({key: [0] * (NUM_LAYERS + NUM_MTP)})


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(no_limits("swiglu_limits"), id="routed-clamp"),
        pytest.param(no_limits("swiglu_limits_shared"), id="shared-and-dense-clamp"),
        pytest.param(lambda config: config.update(sliding_window=10_000), id="window"),
        pytest.param(lambda config: config.update(partial_rotary_factors=[1.0] * 6), id="partial-rotary"),
        pytest.param(lambda config: config.update(rope_theta=50000.0), id="rope-theta-per-type"),
        pytest.param(lambda config: config.update(moe_router_scaling_factor=1.0), id="routed-scaling"),
    ],
)
def test_each_feature_changes_the_output(
    checkpoints: Checkpoints, tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    # Negative controls for the parity tests: the same weights read with one feature switched off must not match.
    directory = shutil.copytree(checkpoints.directories["step3p5-hub"], tmp_path / "edited")
    edit_config(directory, edit)
    sequence = token_ids(22, seed=2)
    logits, _ = run_chunks(load_target(directory), [[sequence]])
    difference = (logits[0] - reference_forward(checkpoints.reference, sequence).logits).abs().max().item()
    assert difference > 100 * TOLERANCE


@pytest.mark.parametrize("kind", KINDS)
def test_mtp_and_vision_tensors_are_not_read(
    checkpoints: Checkpoints, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    stored = load_file(str(checkpoints.directories[kind] / "model.safetensors"))
    assert f"model.layers.{NUM_LAYERS + 1}.transformer.self_attn.q_proj.weight" in stored
    with caplog.at_level(logging.INFO, logger="tandem.models.registry"):
        model = load_target(checkpoints.directories[kind])
    assert "not used" not in caplog.text  # neither MTP nor vision tensors are reported as unused
    assert f"model.layers.{{>= {NUM_LAYERS}}}" in caplog.text
    assert isinstance(model, Step3p5ForCausalLM) and len(model.model.layers) == NUM_LAYERS


def test_legacy_and_transformers_configs_translate_alike(checkpoints: Checkpoints) -> None:
    saved = json.loads((checkpoints.directories["step3p7"] / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"] and "rope_parameters" in saved["text_config"]
    legacy, current = Step3p5Config.from_hf(LEGACY_CONFIG), Step3p5Config.from_hf(saved)
    assert replace(current, architecture=legacy.architecture, eos_token_ids=legacy.eos_token_ids) == legacy
    assert legacy.layer_heads == (6, 4, 6, 4) and legacy.moe_layers == (False, True, True, True)
    assert [rope.rotary_dim for rope in legacy.ropes] == [16, 8]
    assert legacy.swiglu_limits == (None, 7.0, None, 0.4)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"layer_types": [SLIDING, FULL, SLIDING]}, "layer_types"),
        ({"layer_types": ["minimax_m3_sparse"] * 6}, "layer_types"),
        ({"rope_theta": [1000.0, 50000.0, 2000.0, 50000.0, 0, 0]}, "rope_theta"),
        ({"partial_rotary_factors": [0.3125, 1.0, 0.3125, 1.0, 0, 0]}, "partial_rotary_factor"),
        ({"attention_other_setting": {"num_attention_heads": 6, "num_attention_groups": 4}}, "attention_other_setting"),
        ({"per_layer_config": {"0": {"head_dim": 8}}}, "per_layer_config"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"gating": "per-element"}, "gating"),
        ({"moe_top_k": 9}, "num_experts_per_tok"),
        ({"attention_other_setting": {"num_attention_heads": 5}}, "num_attention_heads"),
        ({"use_head_wise_attn_gate": False}, "gating"),
        ({"moe_router_activation": "softmax"}, "moe_router_activation"),
        ({"use_moe_router_bias": False}, "use_moe_router_bias"),
        ({"norm_expert_weight": False}, "norm_expert_weight"),
        ({"yarn_only_types": [SLIDING]}, "yarn_only_types"),
        ({"use_rope_layers": [True, False, True, True, True, True]}, "use_rope_layers"),
        ({"rope_scaling": {"type": "llama3", "factor": 2.0}}, "rope_scaling"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ],
)
def test_unsupported_variants_are_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        Step3p5Config.from_hf(LEGACY_CONFIG | changes)


@pytest.mark.parametrize(
    ("changes", "tp", "message"),
    [
        ({}, 4, "tp 4 does not divide num_sliding_attention_heads 6"),
        ({"attention_other_setting": {"num_attention_heads": 8}}, 8, "tp 8 does not divide num_key_value_heads 2"),
        ({"moe_intermediate_size": 33}, 2, "tp 2 does not divide moe_intermediate_size 33"),
        ({"share_expert_dim": 33}, 2, "tp 2 does not divide share_expert_dim 33"),
    ],
)
def test_tensor_parallel_refuses_shapes_it_cannot_split(
    tmp_path: Path, changes: dict[str, Any], tp: int, message: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LEGACY_CONFIG | changes))
    check_tensor_parallel(tmp_path, 1)
    with pytest.raises(ParallelismError, match=message):
        check_tensor_parallel(tmp_path, tp)


def test_router_bias_stays_float32_when_serving_bfloat16(checkpoints: Checkpoints) -> None:
    model = load_target(checkpoints.directories["step3p7"], dtype=torch.bfloat16)
    assert isinstance(model, Step3p5ForCausalLM)
    moe = model.model.layers[1].moe
    assert isinstance(moe, Step3p5Experts)
    assert moe.gate.weight.dtype == torch.bfloat16 and moe.router_bias.dtype == torch.float32
    reference = checkpoints.reference.model.language_model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(moe.router_bias, reference)


def test_tp2_matches_tp1(checkpoints: Checkpoints, tmp_path: Path) -> None:
    # The scenario of tests/unit/test_tensor_parallel.py (packed steps on the paged cache, greedy and drafted rounds
    # through the runner) at tp 2, two real processes over gloo, against tp 1 in this process. At tp 2 each rank
    # holds 3 sliding or 2 full query heads and their gate rows, 1 KV head, and half of every expert's units.
    directory = checkpoints.directories["step3p5-hub"]
    at_tp2 = scenario_at_tp2({"step": directory}, tmp_path / "scenario.pt")["step"]
    at_tp1 = scenario(start_target(TargetSettings(model_dir=directory, cache=CACHE)))
    assert max_difference(at_tp2["logits"], at_tp1["logits"]) <= TOLERANCE
    assert max_difference(at_tp2["streams"], at_tp1["streams"]) <= TOLERANCE
    assert at_tp2["tokens"] == at_tp1["tokens"]


@pytest.mark.skipif(not ONEDNN, reason="prepack makes oneDNN copies, and this PyTorch has no oneDNN")
def test_stacked_experts_get_no_prepacked_copy(checkpoints: Checkpoints) -> None:
    # They are multiplied one expert's rows at a time: a oneDNN copy of the whole stack would only double its memory.
    model = load_target(checkpoints.directories["step3p7"])
    assert isinstance(model, Step3p5ForCausalLM) and prepack(model) > 0
    layer = model.model.layers[1]
    assert isinstance(layer, Step3p5DecoderLayer) and layer.moe is not None
    assert layer.moe.gate_up_proj.prepacked is None and layer.self_attn.qkv_proj.prepacked is not None
