"""Tiny random DeepSeek-V3 checkpoints written with transformers' own classes, plus the test tokenizer.

Every one has hidden 64, vocabulary 320, a dense first layer then MoE layers of 8 routed experts in 2 groups (1 group
and 2 experts per token) plus 1 shared expert, and YaRN rope with DeepSeek-V3's factor, betas and original context.
The spec chooses low-rank or plain queries, the rope pair layout, YaRN's mscale_all_dim, and NextN (MTP) layers stored
after the decoder layers, as DeepSeek ships them: each a decoder layer that transformers builds and writes (an MoE
layer, by the index rule, with transformers' own tensor names and shapes) plus the NextN layer's own tensors.

Weights are drawn as tests.helpers.checkpoints draws them (seeded, larger than default init, global RNG untouched);
the router's are drawn at their own scales, so that no expert choice is a near-tie.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

from tests.helpers.checkpoints import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, redraw_parameters
from tests.helpers.mtp_checkpoints import layer_copies, mtp_own_tensors
from tests.helpers.tokenizer import write_tokenizer

VOCAB_SIZE = 320
HIDDEN_SIZE = 64
KV_LORA_RANK = 32
ROPE_DIM = 8  # qk_rope_head_dim
# DeepSeek-V3's own mscale_all_dim is 1 (== mscale): the cos/sin scale is then 1. Any other value makes both the
# cos/sin scale (mscale over mscale_all_dim) and the softmax scale (mscale_all_dim) differ from 1.
YARN_MSCALE_ALL_DIM = 0.8
# A router weight std of 0.2 with hidden 64 gives gate logits of std about 1.6: sigmoid scores spread over most of
# (0, 1), so the experts' scores stand apart instead of crowding near 0.5. The bias is large enough to change some
# choices (tests/unit/test_deepseek_v3.py asserts that, and that no decision of its data is a near-tie).
ROUTER_WEIGHT_STD = 0.2
ROUTER_BIAS_STD = 0.1


@dataclass(frozen=True)
class TinyDeepseekSpec:
    num_layers: int = 3
    # None: plain q_proj ("q_lora_rank": null).
    q_lora_rank: int | None = 32
    # DeepSeek's interleaved rope pairs (2i, 2i + 1); False: rotate-half (i with i + rope_dim / 2).
    rope_interleave: bool = True
    mscale_all_dim: float = YARN_MSCALE_ALL_DIM
    # NextN layers at model.layers.{num_layers + i}.*, written with config num_nextn_predict_layers.
    num_nextn_layers: int = 0
    # The NextN layers' own copies of the shared tables (embed_tokens, shared_head.head), as DeepSeek stores them,
    # filled with zeros: a loader that used them would give all-zero logits (every draft token id 0).
    nextn_layer_copies: bool = True
    seed: int = 0


# A 2-layer target whose checkpoint also holds one NextN layer, with DeepSeek-V3's own mscale_all_dim.
DEEPSEEK_NEXTN = TinyDeepseekSpec(num_layers=2, mscale_all_dim=1.0, num_nextn_layers=1)


def deepseek_v3_yarn(mscale_all_dim: float = YARN_MSCALE_ALL_DIM) -> dict[str, Any]:
    """DeepSeek-V3's YaRN settings, in config.json's older rope_scaling form ("type"), except mscale_all_dim. With
    qk_rope_head_dim 8 the YaRN bounds fall on pairs 1 and 3, so the four frequency pairs are kept, kept, blended and
    slowed down (tandem.layers.rotary)."""
    return {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": mscale_all_dim,
    }


def tiny_deepseek_config(spec: TinyDeepseekSpec) -> DeepseekV3Config:
    """The config of the model transformers builds: its decoder layers count the NextN layers too."""
    yarn = {key: value for key, value in deepseek_v3_yarn(spec.mscale_all_dim).items() if key != "type"}
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=spec.num_layers + spec.num_nextn_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **yarn},
        rope_interleave=spec.rope_interleave,
        max_position_embeddings=40 * 4096,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        dtype="float32",
    )


def redraw_weights(model: DeepseekV3ForCausalLM, generator: torch.Generator) -> None:
    """Every parameter as tests.helpers.checkpoints draws them except the router's gate weights; then the router's
    bias buffers (e_score_correction_bias), which transformers initialises to zeros."""
    redraw_parameters(model, generator, stds={"mlp.gate.weight": ROUTER_WEIGHT_STD})
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * ROUTER_BIAS_STD)


def write_tiny_deepseek(directory: Path, spec: TinyDeepseekSpec = TinyDeepseekSpec()) -> Path:
    """Writes a random DeepSeek-V3 checkpoint with its tokenizer and generation config into directory; returns it."""
    config = tiny_deepseek_config(spec)
    # The constructor's own init draws from the global RNG; fork it so the caller's random stream is unchanged.
    with torch.random.fork_rng(devices=[]):
        model = DeepseekV3ForCausalLM(config)
    generator = torch.Generator().manual_seed(spec.seed)
    redraw_weights(model, generator)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(directory)
    write_tokenizer(directory, VOCAB_SIZE)
    if spec.num_nextn_layers:
        add_nextn_tensors(directory, spec, generator)
    return directory


def add_nextn_tensors(directory: Path, spec: TinyDeepseekSpec, generator: torch.Generator) -> None:
    """Adds each NextN layer's own tensors (enorm, hnorm, eh_proj, shared_head.norm) to the decoder-layer weights
    transformers wrote for it, and tells the NextN layers apart from the decoder layers in config.json."""
    tensors = load_file(str(directory / "model.safetensors"))
    for index in range(spec.num_nextn_layers):
        prefix = f"model.layers.{spec.num_layers + index}."
        tensors |= mtp_own_tensors(prefix, HIDDEN_SIZE, generator)
        if spec.nextn_layer_copies:
            tensors |= layer_copies(prefix, VOCAB_SIZE, HIDDEN_SIZE)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config |= {"num_hidden_layers": spec.num_layers, "num_nextn_predict_layers": spec.num_nextn_layers}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
