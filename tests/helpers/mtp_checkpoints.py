"""Tiny MTP draft checkpoints in the target-checkpoint format of tandem.models.mtp.

- `write_tiny_chained_mtp`: N chained MTP layers for a tiny Llama target written by tests.helpers.checkpoints: a
  directory with the target's config.json plus num_nextn_predict_layers, holding only model.layers.{L+i}.*.
- `write_tiny_deepseek_nextn`: a tiny DeepSeek-V3 target checkpoint with one NextN layer at model.layers.{L}.*, as
  DeepSeek ships it. The NextN layer's decoder weights come from a transformers DeepseekV3ForCausalLM built with
  L + 1 layers, so its MoE layer has transformers' own tensor names and shapes.

Weights are seeded and as large as in tests.helpers.checkpoints (argmaxes a few units apart, not near-ties); the MoE
router is drawn as tests/unit/test_deepseek_v3.py draws it, so that expert choices are not near-ties either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from tests.helpers.checkpoints import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, dense_weight, norm_weight

DEEPSEEK_NUM_LAYERS = 2
ROUTER_WEIGHT_STD = 0.2
ROUTER_BIAS_STD = 0.1


@dataclass(frozen=True)
class TinyChainedMTPSpec:
    num_mtp_layers: int = 3
    # Copy the target's model.embed_tokens.weight and lm_head.weight in (else the loader reports them missing).
    include_shared_tables: bool = False
    # Per-layer copies of the shared tables, as DeepSeek stores them, filled with zeros: a loader that used them would
    # give all-zero logits (every draft token id 0).
    include_layer_copies: bool = False
    seed: int = 0


def mtp_own_tensors(prefix: str, hidden: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """enorm, hnorm, eh_proj and shared_head.norm of one MTP layer."""
    return {
        prefix + "enorm.weight": norm_weight((hidden,), generator),
        prefix + "hnorm.weight": norm_weight((hidden,), generator),
        prefix + "eh_proj.weight": dense_weight((hidden, 2 * hidden), generator),
        prefix + "shared_head.norm.weight": norm_weight((hidden,), generator),
    }


def layer_copies(prefix: str, vocab: int, hidden: int) -> dict[str, torch.Tensor]:
    return {
        prefix + "embed_tokens.weight": torch.zeros(vocab, hidden),
        prefix + "shared_head.head.weight": torch.zeros(vocab, hidden),
    }


def write_tiny_chained_mtp(directory: Path, target_dir: Path, spec: TinyChainedMTPSpec = TinyChainedMTPSpec()) -> Path:
    """MTP layers for the Llama target in target_dir (Llama decoder layers: q/k/v/o, gate/up/down, two norms)."""
    target_config: dict[str, Any] = json.loads((target_dir / "config.json").read_text())
    num_layers, hidden = target_config["num_hidden_layers"], target_config["hidden_size"]
    num_heads, num_kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or hidden // num_heads
    intermediate, vocab = target_config["intermediate_size"], target_config["vocab_size"]
    generator = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(spec.num_mtp_layers):
        prefix = f"model.layers.{num_layers + index}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": dense_weight((num_heads * head_dim, hidden), generator),
            prefix + "self_attn.k_proj.weight": dense_weight((num_kv_heads * head_dim, hidden), generator),
            prefix + "self_attn.v_proj.weight": dense_weight((num_kv_heads * head_dim, hidden), generator),
            prefix + "self_attn.o_proj.weight": dense_weight((hidden, num_heads * head_dim), generator),
            prefix + "mlp.gate_proj.weight": dense_weight((intermediate, hidden), generator),
            prefix + "mlp.up_proj.weight": dense_weight((intermediate, hidden), generator),
            prefix + "mlp.down_proj.weight": dense_weight((hidden, intermediate), generator),
            prefix + "input_layernorm.weight": norm_weight((hidden,), generator),
            prefix + "post_attention_layernorm.weight": norm_weight((hidden,), generator),
            **mtp_own_tensors(prefix, hidden, generator),
        }
        if spec.include_layer_copies:
            tensors |= layer_copies(prefix, vocab, hidden)
    if spec.include_shared_tables:
        target = load_file(str(target_dir / "model.safetensors"))
        tensors |= {name: target[name] for name in ("model.embed_tokens.weight", "lm_head.weight")}
    directory.mkdir(parents=True, exist_ok=True)
    config = target_config | {"num_nextn_predict_layers": spec.num_mtp_layers}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def tiny_deepseek_config(num_layers: int) -> DeepseekV3Config:
    """Low-rank queries, interleaved rope with DeepSeek-V3's YaRN, one dense layer then MoE (8 experts, 2 groups)."""
    return DeepseekV3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,
        max_position_embeddings=40 * 4096,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        dtype="float32",
    )


def write_tiny_deepseek_nextn(directory: Path, include_layer_copies: bool = True, seed: int = 0) -> Path:
    """A DeepSeek-V3 target of DEEPSEEK_NUM_LAYERS layers whose checkpoint also holds one NextN layer (an MoE layer,
    by the index rule) at model.layers.{DEEPSEEK_NUM_LAYERS}.*; config.json says num_nextn_predict_layers 1."""
    config = tiny_deepseek_config(DEEPSEEK_NUM_LAYERS + 1)
    # The constructor's own init draws from the global RNG; fork it so the caller's random stream is unchanged.
    with torch.random.fork_rng(devices=[]):
        model = DeepseekV3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                parameter.copy_(norm_weight(tuple(parameter.shape), generator))
            elif name.endswith("mlp.gate.weight"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * ROUTER_WEIGHT_STD)
            else:
                parameter.copy_(dense_weight(tuple(parameter.shape), generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * ROUTER_BIAS_STD)
    model.save_pretrained(directory)
    prefix = f"model.layers.{DEEPSEEK_NUM_LAYERS}."
    tensors = load_file(str(directory / "model.safetensors")) | mtp_own_tensors(prefix, config.hidden_size, generator)
    if include_layer_copies:
        tensors |= layer_copies(prefix, config.vocab_size, config.hidden_size)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    hf |= {"num_hidden_layers": DEEPSEEK_NUM_LAYERS, "num_nextn_predict_layers": 1}
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return directory
