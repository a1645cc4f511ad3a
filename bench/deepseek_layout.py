"""DeepSeek-V3's release layout: its config.json as released and every tensor's name, dtype and shape for a config,
as deepseek-ai ships them (block-wise fp8 projections with float32 scales, the rest in bfloat16). Checkpoints are
written by it with no data (tests.helpers.header_checkpoints: `tandem plan` on the 671B model) or with random data
at a smaller config (bench.quantized_memory).
"""

from __future__ import annotations

import math
from typing import Any

# The header of a tensor: its safetensors dtype and shape.
Tensors = dict[str, tuple[str, tuple[int, ...]]]


def deepseek_v3_config() -> dict[str, Any]:
    """DeepSeek-V3's config.json as released (deepseek-ai/DeepSeek-V3), the keys Tandem and transformers read."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 129280,
    }


def deepseek_v3_tensors(hf: dict[str, Any]) -> Tensors:
    """The tensors of a DeepSeek-V3 release for config `hf`, under the release's names: embedding, norms, routers and
    head in bfloat16, the router's bias in float32, every other projection fp8 with its float32 block scales; the
    NextN layers after the last decoder layer, each a MoE decoder layer plus its own tensors."""
    hidden, vocab = hf["hidden_size"], hf["vocab_size"]
    tensors: Tensors = {"model.embed_tokens.weight": ("BF16", (vocab, hidden))}
    num_layers = hf["num_hidden_layers"]
    for layer in range(num_layers + hf["num_nextn_predict_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "input_layernorm.weight": ("BF16", (hidden,)),
            prefix + "post_attention_layernorm.weight": ("BF16", (hidden,)),
        }
        tensors |= _latent_attention(prefix + "self_attn.", hf)
        tensors |= _mlp(prefix + "mlp.", hf, dense=layer < hf["first_k_dense_replace"])
        if layer >= num_layers:
            tensors |= {
                prefix + "enorm.weight": ("BF16", (hidden,)),
                prefix + "hnorm.weight": ("BF16", (hidden,)),
                prefix + "eh_proj.weight": ("BF16", (hidden, 2 * hidden)),
                prefix + "embed_tokens.weight": ("BF16", (vocab, hidden)),
                prefix + "shared_head.norm.weight": ("BF16", (hidden,)),
                prefix + "shared_head.head.weight": ("BF16", (vocab, hidden)),
            }
    tensors |= {"model.norm.weight": ("BF16", (hidden,)), "lm_head.weight": ("BF16", (vocab, hidden))}
    return tensors


def _fp8(name: str, rows: int, columns: int, hf: dict[str, Any]) -> Tensors:
    block_rows, block_columns = hf["quantization_config"]["weight_block_size"]
    grid = (math.ceil(rows / block_rows), math.ceil(columns / block_columns))
    return {name + ".weight": ("F8_E4M3", (rows, columns)), name + ".weight_scale_inv": ("F32", grid)}


def _latent_attention(prefix: str, hf: dict[str, Any]) -> Tensors:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    q_rank, kv_rank, rope = hf["q_lora_rank"], hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    nope, value = hf["qk_nope_head_dim"], hf["v_head_dim"]
    return {
        **_fp8(prefix + "q_a_proj", q_rank, hidden, hf),
        prefix + "q_a_layernorm.weight": ("BF16", (q_rank,)),
        **_fp8(prefix + "q_b_proj", heads * (nope + rope), q_rank, hf),
        **_fp8(prefix + "kv_a_proj_with_mqa", kv_rank + rope, hidden, hf),
        prefix + "kv_a_layernorm.weight": ("BF16", (kv_rank,)),
        **_fp8(prefix + "kv_b_proj", heads * (nope + value), kv_rank, hf),
        **_fp8(prefix + "o_proj", hidden, heads * value, hf),
    }


def _gated(prefix: str, hidden: int, units: int, hf: dict[str, Any]) -> Tensors:
    return {
        **_fp8(prefix + "gate_proj", units, hidden, hf),
        **_fp8(prefix + "up_proj", units, hidden, hf),
        **_fp8(prefix + "down_proj", hidden, units, hf),
    }


def _mlp(prefix: str, hf: dict[str, Any], dense: bool) -> Tensors:
    hidden = hf["hidden_size"]
    if dense:
        return _gated(prefix, hidden, hf["intermediate_size"], hf)
    experts, units = hf["n_routed_experts"], hf["moe_intermediate_size"]
    tensors: Tensors = {
        prefix + "gate.weight": ("BF16", (experts, hidden)),
        prefix + "gate.e_score_correction_bias": ("F32", (experts,)),
    }
    for expert in range(experts):
        tensors |= _gated(f"{prefix}experts.{expert}.", hidden, units, hf)
    return tensors | _gated(prefix + "shared_experts.", hidden, units * hf["n_shared_experts"], hf)


def int4_experts_config(group: int) -> dict[str, Any]:
    """quantization_config as Kimi-K2.5's text_config has it (there with groups of 32): compressed-tensors'
    pack-quantized symmetric INT4 for the routed experts, everything else left float."""
    weights: dict[str, Any] = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
    }
    group_0 = {"input_activations": None, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group_0},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def int4_experts_tensors(fp8_tensors: Tensors, group: int) -> Tensors:
    """Kimi-K2.5's layout from DeepSeek-V3's tensor list: the routed experts' projections INT4 (weight_packed int32
    words, bfloat16 weight_scale per group, weight_shape), every other fp8 weight bfloat16 with no scales."""
    tensors: Tensors = {}
    for name, (dtype, shape) in fp8_tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if dtype != "F8_E4M3":
            tensors[name] = (dtype, shape)
        elif ".mlp.experts." in name:
            prefix = name.removesuffix("weight")
            rows, columns = shape
            tensors[prefix + "weight_packed"] = ("I32", (rows, math.ceil(columns / 8)))
            tensors[prefix + "weight_scale"] = ("BF16", (rows, math.ceil(columns / group)))
            tensors[prefix + "weight_shape"] = ("I64", (2,))
        else:
            tensors[name] = ("BF16", shape)
    return tensors
