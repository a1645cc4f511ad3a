"""Our DeepSeek-V3 / Kimi-K2 target on the paged, compressed MLA cache against transformers, on tiny random
checkpoints written by transformers itself (fp32).

Two variants: low-rank queries (q_lora_rank) with DeepSeek's interleaved rope layout and a YaRN cos/sin scale
other than 1 (mscale != mscale_all_dim); plain q_proj (q_lora_rank null) with the rotate-half layout and
DeepSeek-V3's own mscale == mscale_all_dim. Both have YaRN with DeepSeek-V3's factor, betas and original context,
a dense first layer then MoE layers of 8 routed experts in 2 groups (1 group and 2 experts per token) plus 1 shared
expert. Covered: logits and aux capture for prefill, decode chunks and a packed batch; the router's expert choices;
the cache's layout and content; NextN / MTP layers in the checkpoint; the kimi_k2 config alias; config refusals.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from tandem.layers.kv_cache import CacheLayout, SequenceKV
from tandem.layers.moe import GroupedTopKRouter, MixtureOfExperts
from tandem.models import deepseek_v3
from tandem.models.config import ConfigError
from tandem.models.registry import load_target
from tests.helpers.deepseek_checkpoints import (
    KV_LORA_RANK,
    ROPE_DIM,
    TinyDeepseekSpec,
    tiny_deepseek_config,
    write_tiny_deepseek,
)
from tests.helpers.parity import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_matches,
    make_cache,
    reference_forward,
    run_chunks,
    split,
    token_ids,
)

NUM_LAYERS = 3
# Our router and transformers' see inputs that differ by about 1e-6 (float32 rounding in different operation
# orders). A decision won by less than this could flip between the two without any bug, so the data must not have
# one: the test fails, naming the margin, if a change of seeds or shapes produces such a near-tie. The router's
# weights are drawn large enough for that (tests.helpers.deepseek_checkpoints); seeds are fixed.
MIN_ROUTING_MARGIN = 1e-4

SPECS = {
    "q-lora-interleaved-rope": TinyDeepseekSpec(
        num_layers=NUM_LAYERS, q_lora_rank=32, rope_interleave=True, mscale_all_dim=0.8
    ),
    "plain-q-rotate-half-rope": TinyDeepseekSpec(
        num_layers=NUM_LAYERS, q_lora_rank=None, rope_interleave=False, mscale_all_dim=1.0, seed=1
    ),
}


@dataclass(frozen=True)
class Models:
    directory: Path
    ours: deepseek_v3.DeepseekV3ForCausalLM
    reference: PreTrainedModel


@pytest.fixture(scope="module", params=sorted(SPECS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Models:
    directory = write_tiny_deepseek(tmp_path_factory.mktemp(request.param), SPECS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = load_target(directory)
    assert isinstance(ours, deepseek_v3.DeepseekV3ForCausalLM)
    return Models(directory=directory, ours=ours, reference=reference)


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """config.json of the first variant, as transformers writes it (no weights)."""
    directory = tmp_path_factory.mktemp("config-only")
    tiny_deepseek_config(SPECS["q-lora-interleaved-rope"]).save_pretrained(directory)
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return config


def test_single_prefill(models: Models) -> None:
    prompt = token_ids(11, seed=1)
    logits, captured = run_chunks(models.ours, [[prompt]])
    assert_matches(logits[0], captured[0], reference_forward(models.reference, prompt))


@pytest.mark.parametrize("chunk_sizes", [[5, 1, 1, 1, 1, 1], [3, 4, 4, 1, 4]])
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


@dataclass(frozen=True)
class RouterCall:
    layer_index: int
    hidden: torch.Tensor  # [num_tokens, hidden] the router's input
    logits: torch.Tensor  # [num_tokens, num_experts] transformers' gate logits
    weights: torch.Tensor  # [num_tokens, experts_per_token]
    experts: torch.Tensor  # [num_tokens, experts_per_token]


def reference_router_calls(model: PreTrainedModel, token_ids: Sequence[int]) -> list[RouterCall]:
    calls: list[RouterCall] = []
    handles = []
    for layer_index, layer in enumerate(model.get_decoder().layers):
        if not hasattr(layer.mlp, "gate"):
            continue

        def record(module: torch.nn.Module, inputs: Any, output: Any, layer_index: int = layer_index) -> None:
            router_logits, weights, experts = output
            hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
            calls.append(RouterCall(layer_index, hidden, router_logits, weights, experts))

        handles.append(layer.mlp.gate.register_forward_hook(record))
    try:
        with torch.no_grad():
            model(torch.tensor([list(token_ids)]))
    finally:
        for handle in handles:
            handle.remove()
    return calls


def smallest_routing_margin(call: RouterCall, router: GroupedTopKRouter) -> float:
    """The closest decision in this call: group ranking at the topk_group boundary, then expert ranking within the
    kept groups at the experts_per_token boundary, from transformers' logits (independent of our router)."""
    config = router.config
    choice = call.logits.sigmoid() + router.e_score_correction_bias
    grouped = choice.view(choice.shape[0], config.num_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1).sort(dim=-1, descending=True).values
    group_margin = group_scores[:, config.groups_per_token - 1] - group_scores[:, config.groups_per_token]
    kept = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(config.groups_per_token, dim=-1).indices
    kept_choice = torch.gather(grouped, 1, kept[:, :, None].expand(-1, -1, grouped.shape[-1])).flatten(1)
    kept_choice = kept_choice.sort(dim=-1, descending=True).values
    expert_margin = kept_choice[:, config.experts_per_token - 1] - kept_choice[:, config.experts_per_token]
    return min(group_margin.min().item(), expert_margin.min().item())


def test_router_chooses_the_experts_transformers_chooses(models: Models) -> None:
    sequence = token_ids(24, seed=7)
    calls = reference_router_calls(models.reference, sequence)
    assert [call.layer_index for call in calls] == [1, 2]  # first_k_dense_replace 1: layer 0 is dense
    plain_top_k_differs = False
    for call in calls:
        moe = models.ours.model.layers[call.layer_index].mlp
        assert isinstance(moe, MixtureOfExperts)
        margin = smallest_routing_margin(call, moe.gate)
        assert margin > MIN_ROUTING_MARGIN, f"layer {call.layer_index}: near-tie in the test data ({margin:.2e})"
        with torch.no_grad():
            routing = moe.gate(call.hidden)
        # Both sides use unsorted top-k, so compare the chosen experts as sets, with weights in the same order.
        ours_order, reference_order = routing.experts.sort(dim=-1), call.experts.sort(dim=-1)
        assert torch.equal(ours_order.values, reference_order.values), f"layer {call.layer_index}"
        ours_weights = routing.weights.gather(1, ours_order.indices)
        reference_weights = call.weights.gather(1, reference_order.indices)
        assert (ours_weights - reference_weights).abs().max().item() <= 1e-6
        # The data exercises the bias and the groups: plain top-k of the scores would choose otherwise somewhere.
        plain = call.logits.sigmoid().topk(2, dim=-1).indices.sort(dim=-1).values
        plain_top_k_differs |= not torch.equal(plain, reference_order.values)
    assert plain_top_k_differs


def test_cache_keeps_one_compressed_row_per_token(models: Models) -> None:
    model = models.ours
    assert model.config.cache_layout == CacheLayout(num_kv_heads=1, key_dim=KV_LORA_RANK + ROPE_DIM, value_dim=0)
    cache = make_cache(model)
    per_token_per_layer = cache.keys[0, 0].numel() + cache.values[0, 0].numel()
    assert per_token_per_layer == KV_LORA_RANK + ROPE_DIM

    prompt = token_ids(9, seed=8)
    sequence = SequenceKV()
    metadata = cache.plan([(sequence, len(prompt))])
    with torch.no_grad():
        model(torch.tensor(prompt), metadata, cache)
    # transformers caches the same two things for DeepSeek-V3: the normed latent as "keys", the rope'd k as "values".
    past = DynamicCache(config=models.reference.config)
    with torch.no_grad():
        models.reference(torch.tensor([prompt]), past_key_values=past, use_cache=True)
    slots = cache.slots(sequence, 0, len(prompt))
    for layer_index in range(NUM_LAYERS):
        layer = past.layers[layer_index]
        assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
        expected = torch.cat((layer.keys[0, 0], layer.values[0, 0]), dim=-1)  # [prompt, kv_lora_rank + rope]
        rows = cache.keys[layer_index].index_select(0, slots)[:, 0]  # [prompt, kv_lora_rank + rope]
        assert (rows - expected).abs().max().item() <= 1e-5, f"layer {layer_index}"


def test_router_bias_stays_float32_when_serving_bfloat16(models: Models) -> None:
    model = load_target(models.directory, dtype=torch.bfloat16)
    assert isinstance(model, deepseek_v3.DeepseekV3ForCausalLM)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MixtureOfExperts)
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    reference_bias = models.reference.get_decoder().layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(moe.gate.e_score_correction_bias, reference_bias)


def prompt_logits(model: deepseek_v3.DeepseekV3ForCausalLM, prompt: Sequence[int]) -> torch.Tensor:
    logits, _ = run_chunks(model, [[prompt]])
    return logits[0]


def test_mtp_layers_in_the_checkpoint_are_skipped(
    models: Models, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A NextN layer as DeepSeek-V3 stores it, under the first index past the last layer: a full decoder layer (here
    # a copy of layer 2) plus enorm, hnorm, eh_proj and shared_head.norm. Then one stray tensor, which must warn.
    directory = shutil.copytree(models.directory, tmp_path / "with-mtp")
    tensors = load_file(str(directory / "model.safetensors"))
    layer_prefix, mtp_prefix = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
    mtp = {
        mtp_prefix + name[len(layer_prefix) :]: tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(layer_prefix)
    }
    mtp[mtp_prefix + "enorm.weight"] = torch.ones(64)
    mtp[mtp_prefix + "hnorm.weight"] = torch.ones(64)
    mtp[mtp_prefix + "eh_proj.weight"] = torch.zeros(64, 128)
    mtp[mtp_prefix + "shared_head.norm.weight"] = torch.ones(64)
    save_file(tensors | mtp, str(directory / "model.safetensors"), metadata={"format": "pt"})

    prompt = token_ids(6, seed=9)
    with caplog.at_level(logging.WARNING, logger="tandem.models.registry"):
        model = load_target(directory)
    assert isinstance(model, deepseek_v3.DeepseekV3ForCausalLM)
    assert [record.getMessage() for record in caplog.records if record.name == "tandem.models.registry"] == []
    assert torch.equal(prompt_logits(model, prompt), prompt_logits(models.ours, prompt))

    stray = {"model.stray.weight": torch.zeros(2)}
    save_file(tensors | mtp | stray, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="tandem.models.registry"):
        load_target(directory)
    assert "model.stray.weight" in caplog.text
    assert mtp_prefix not in caplog.text


def kimi_k2_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The same model described as Kimi-K2's config.json does: model_type kimi_k2, remote-code auto_map, rope in
    the older rope_theta + rope_scaling form (YaRN under "type"), the router's method keys."""
    rope = {key: value for key, value in hf["rope_parameters"].items() if key not in ("rope_type", "rope_theta")}
    kimi = {key: value for key, value in hf.items() if key != "rope_parameters"}
    return kimi | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "rope_theta": hf["rope_parameters"]["rope_theta"],
        "rope_scaling": {"type": "yarn", **rope},
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
    }


def test_kimi_k2_model_type_alias_loads(models: Models, tmp_path: Path) -> None:
    directory = shutil.copytree(models.directory, tmp_path / "kimi-k2")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(kimi_k2_config(hf)))
    model = load_target(directory)
    assert isinstance(model, deepseek_v3.DeepseekV3ForCausalLM)
    assert model.config.rope == models.ours.config.rope
    prompt = token_ids(6, seed=10)
    assert torch.equal(prompt_logits(model, prompt), prompt_logits(models.ours, prompt))


def test_moe_layer_freq_places_moe_layers_as_deepseek_does(hf_config: dict[str, Any]) -> None:
    config = deepseek_v3.DeepseekV3Config.from_hf(hf_config | {"num_hidden_layers": 7, "moe_layer_freq": 2})
    assert [config.is_moe_layer(index) for index in range(7)] == [False, False, True, False, True, False, True]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # fp8 and compressed-tensors INT4 are read (tests/unit/test_quantized_checkpoints.py).
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config.quant_method"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(
    hf_config: dict[str, Any], change: dict[str, Any], field: str
) -> None:
    deepseek_v3.DeepseekV3Config.from_hf(hf_config)  # the unchanged config is accepted
    with pytest.raises(ConfigError, match=f"^{field}: "):
        deepseek_v3.DeepseekV3Config.from_hf(hf_config | change)


def test_target_runner_serves_the_latent_cache(tmp_path: Path) -> None:
    """The target runner builds its cache from cache_layout (no value rows) and verifies drafts with it."""
    from tandem.sampling.params import SamplingParams
    from tandem.settings import KVCacheSettings
    from target_server.runner import TargetRunner

    model = load_target(write_tiny_deepseek(tmp_path, SPECS["q-lora-interleaved-rope"]))
    runner = TargetRunner(model, KVCacheSettings(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE), max_context=256)
    assert runner.cache.keys.shape[-2:] == (1, KV_LORA_RANK + ROPE_DIM)
    assert runner.cache.values.shape[-1] == 0
    prompt = [5, 9, 14, 3, 7, 11]
    reference = prompt_logits(model, prompt).argmax(-1)  # greedy continuation of the prompt, 1 token
    first = runner.prefill("a", prompt, SamplingParams()).new_tokens[0]
    assert first == int(reference[-1])
    # Draft the target's own greedy continuation (computed by one-token steps on a second request).
    runner.prefill("b", prompt, SamplingParams())
    own = [runner.verify("b").new_tokens[0] for _ in range(4)]
    result = runner.verify("a", own[:3])
    assert result.accepted == 3 and result.new_tokens == own
