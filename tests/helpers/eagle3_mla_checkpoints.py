"""Tiny EAGLE3 MLA draft heads (Eagle3DeepseekV2ForCausalLM, the kimi-k2.5-eagle3-mla layout) on disk.

No library writes this layout, so it is written by hand from the published format ("EAGLE3 draft checkpoints",
"EAGLE3 with MLA attention"): a DeepSeek-V3 style config.json with one layer, and one safetensors file with
`layers.0.*` (or `midlayer.*`) names, q_a_proj and kv_a_proj_with_mqa as separate tensors whose input is the 2*hidden
concat([embedding, hidden]), kv_b_proj, the two latent norms, a dense gated MLP, and the EAGLE3 head's own tensors
(fc, norm, lm_head over a reduced draft vocabulary, d2t offsets, t2d). tests.helpers.deepseek_checkpoints writes
DeepSeek-V3 targets for it to serve.

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

from tests.helpers.checkpoints import Eagle3HeadSizes, dense_weight, eagle3_head_tensors, norm_weight, random_d2t
from tests.helpers.deepseek_checkpoints import deepseek_v3_yarn


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
    offsets = random_d2t(spec.draft_vocab_size, target_vocab, generator)

    hidden, heads = spec.hidden_size, spec.num_heads
    q_lora_rank = spec.q_lora_rank if spec.q_lora_rank is not None else 24  # tensors are written either way
    attention_input = 2 * hidden  # embedding and hidden state, concatenated
    prefix = spec.weight_prefix
    attention = {
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
    }
    sizes = Eagle3HeadSizes(prefix, hidden, spec.intermediate_size, spec.num_aux * target_hidden, target_vocab)
    tensors = attention | eagle3_head_tensors(sizes, offsets, generator)
    if spec.include_embedding:
        # Unit scale, like a trained embedding's rows after input_layernorm.
        tensors["embed_tokens.weight"] = torch.randn((target_vocab, hidden), generator=generator)

    directory.mkdir(parents=True, exist_ok=True)
    config = eagle3_mla_config(spec, target_config)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


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
