"""Tiny EAGLE3 MLA draft heads (Eagle3DeepseekV2ForCausalLM, the kimi-k2.5-eagle3-mla layout) on disk.

No library writes this layout, so it is written by hand from /work/shared/REFERENCE.md ("EAGLE3 draft checkpoints",
"EAGLE3 with MLA attention"): a DeepSeek-V3 style config.json with one layer, and one safetensors file with
`layers.0.*` (or `midlayer.*`) names, q_a_proj and kv_a_proj_with_mqa as separate tensors whose input is the 2*hidden
concat([embedding, hidden]), kv_b_proj, the two latent norms, a dense gated MLP, and the EAGLE3 head's own tensors
(fc, norm, lm_head over a reduced draft vocabulary, d2t offsets, t2d). `write_tiny_deepseek_target` writes a target
for it to serve, with transformers' own DeepSeek-V3 classes.

Weights are drawn as tests.helpers.checkpoints draws them (seeded, larger than default init, global RNG untouched).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig

from tests.helpers.checkpoints import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    d2t_offsets,
    dense_weight,
    norm_weight,
)
from tests.helpers.tokenizer import write_tokenizer

# A router weight std giving gate logits of std about 1.6 at hidden 64: expert scores stand apart instead of
# crowding near 0.5, so no routing decision is a near-tie (as in tests/unit/test_deepseek_v3.py).
ROUTER_WEIGHT_STD = 0.2


def deepseek_v3_yarn() -> dict[str, Any]:
    """DeepSeek-V3's YaRN settings except mscale_all_dim 0.8, so that both the cos/sin scale (mscale over
    mscale_all_dim) and the softmax scale (mscale_all_dim) differ from 1. With qk_rope_head_dim 8 the four
    frequency pairs are kept, kept, blended and slowed down."""
    return {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    }


@dataclass(frozen=True)
class TinyEagle3MLASpec:
    # The draft's own width, other than the tiny targets' 64: the config then carries target_hidden_size.
    hidden_size: int = 48
    intermediate_size: int = 96
    num_heads: int = 4
    # None writes "q_lora_rank": null; omit_q_lora_rank leaves the key out. Both must be refused by the loader.
    q_lora_rank: int | None = 24
    omit_q_lora_rank: bool = False
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    draft_vocab_size: int = 48
    rope_theta: float = 10000.0  # DeepSeek-V3's, with its YaRN scaling below
    rope_scaling: dict[str, Any] | None = field(default_factory=deepseek_v3_yarn)
    # None leaves the key out: DeepSeek-V3 configs default to the interleaved layout.
    rope_interleave: bool | None = None
    model_type: Literal["kimi_k2", "deepseek_v3"] = "kimi_k2"
    weight_prefix: Literal["layers.0", "midlayer"] = "layers.0"
    # Capture ids in eagle_config; None writes none (the draft falls back to the target's defaults).
    layer_ids: Sequence[int] | None = None
    num_aux: int = 3
    # The draft's own embedding [target_vocab, hidden]: needed when hidden differs from the target's.
    include_embedding: bool = True
    seed: int = 0


def write_tiny_eagle3_mla(directory: Path, target_dir: Path, spec: TinyEagle3MLASpec = TinyEagle3MLASpec()) -> Path:
    """Writes an EAGLE3 MLA head for the target in target_dir into directory and returns directory."""
    target_config = json.loads((target_dir / "config.json").read_text())
    target_vocab, target_hidden = target_config["vocab_size"], target_config["hidden_size"]
    if spec.layer_ids is not None and len(spec.layer_ids) != spec.num_aux:
        raise ValueError(f"num_aux={spec.num_aux} but {len(spec.layer_ids)} layer ids: {list(spec.layer_ids)}")
    if not spec.include_embedding and spec.hidden_size != target_hidden:
        raise ValueError(f"without its own embedding the draft needs the target's width {target_hidden}")
    generator = torch.Generator().manual_seed(spec.seed)
    offsets = reduced_vocabulary_offsets(spec.draft_vocab_size, target_vocab, generator)
    draft_in_target_vocab = torch.zeros(target_vocab, dtype=torch.bool)
    draft_in_target_vocab[[draft_id + offset for draft_id, offset in enumerate(offsets)]] = True

    hidden, heads = spec.hidden_size, spec.num_heads
    q_lora_rank = spec.q_lora_rank if spec.q_lora_rank is not None else 24  # tensors are written either way
    attention_input = 2 * hidden  # embedding and hidden state, concatenated
    prefix = spec.weight_prefix
    tensors: dict[str, torch.Tensor] = {
        f"{prefix}.self_attn.q_a_proj.weight": dense_weight((q_lora_rank, attention_input), generator),
        f"{prefix}.self_attn.q_a_layernorm.weight": norm_weight((q_lora_rank,), generator),
        f"{prefix}.self_attn.q_b_proj.weight": dense_weight(
            (heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim), q_lora_rank), generator
        ),
        f"{prefix}.self_attn.kv_a_proj_with_mqa.weight": dense_weight(
            (spec.kv_lora_rank + spec.qk_rope_head_dim, attention_input), generator
        ),
        f"{prefix}.self_attn.kv_a_layernorm.weight": norm_weight((spec.kv_lora_rank,), generator),
        f"{prefix}.self_attn.kv_b_proj.weight": dense_weight(
            (heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank), generator
        ),
        f"{prefix}.self_attn.o_proj.weight": dense_weight((hidden, heads * spec.v_head_dim), generator),
        f"{prefix}.mlp.gate_proj.weight": dense_weight((spec.intermediate_size, hidden), generator),
        f"{prefix}.mlp.up_proj.weight": dense_weight((spec.intermediate_size, hidden), generator),
        f"{prefix}.mlp.down_proj.weight": dense_weight((hidden, spec.intermediate_size), generator),
        f"{prefix}.input_layernorm.weight": norm_weight((hidden,), generator),
        f"{prefix}.hidden_norm.weight": norm_weight((hidden,), generator),
        f"{prefix}.post_attention_layernorm.weight": norm_weight((hidden,), generator),
        "fc.weight": dense_weight((hidden, spec.num_aux * target_hidden), generator),
        "norm.weight": norm_weight((hidden,), generator),
        "lm_head.weight": dense_weight((spec.draft_vocab_size, hidden), generator),
        "d2t": torch.tensor(offsets, dtype=torch.int64),
        "t2d": draft_in_target_vocab,
    }
    if spec.include_embedding:
        # Unit scale, like a trained embedding's rows after input_layernorm.
        tensors["embed_tokens.weight"] = torch.randn((target_vocab, hidden), generator=generator)

    directory.mkdir(parents=True, exist_ok=True)
    config = eagle3_mla_config(spec, target_config)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def reduced_vocabulary_offsets(draft_vocab: int, target_vocab: int, generator: torch.Generator) -> list[int]:
    """d2t offsets of a seeded random, sorted subset of the target vocabulary that contains id 0."""
    if not 1 <= draft_vocab <= target_vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {target_vocab}], got {draft_vocab}")
    other_ids = torch.randperm(target_vocab - 1, generator=generator)[: draft_vocab - 1] + 1
    return d2t_offsets(sorted([0, *other_ids.tolist()]))


def eagle3_mla_config(spec: TinyEagle3MLASpec, target_config: dict[str, Any]) -> dict[str, Any]:
    """config.json as the Kimi-K2.5 head has it: the target family's keys (MoE keys included, which the head's dense
    MLP ignores), one layer, and the EAGLE3 keys."""
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True}
    if spec.layer_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(spec.layer_ids)
    config: dict[str, Any] = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": spec.model_type,
        "num_hidden_layers": 1,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_heads,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": dict(spec.rope_scaling) if spec.rope_scaling is not None else None,
        "max_position_embeddings": 163840,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": spec.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": eagle_config,
    }
    if spec.omit_q_lora_rank:
        del config["q_lora_rank"]
    if spec.rope_interleave is not None:
        config["rope_interleave"] = spec.rope_interleave
    if spec.hidden_size != target_config["hidden_size"]:
        config["target_hidden_size"] = target_config["hidden_size"]
    if spec.num_aux != 3:
        config["num_aux_hidden_states"] = spec.num_aux
    return config


def write_tiny_deepseek_target(directory: Path, num_layers: int = 4, seed: int = 0) -> Path:
    """A random DeepSeek-V3 target (hidden 64, vocabulary 320, a dense first layer then MoE layers, low-rank queries,
    interleaved YaRN rope) with its tokenizer, saved by transformers; returns directory."""
    config = DeepseekV3Config(
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
        rope_parameters={"rope_theta": 10000.0, **deepseek_v3_yarn(), "rope_type": "yarn"},
        max_position_embeddings=163840,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        dtype="float32",
    )
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
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory
