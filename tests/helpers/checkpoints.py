"""Tiny, real Hugging Face-format checkpoints on disk, for parity and end-to-end tests.

Targets are built with transformers' own config and model classes and saved with save_pretrained, so their files are
exactly what transformers writes. EAGLE3 draft heads have no transformers class; they are written by hand in the
SpecForge / SGLang layout (the SpecForge / SGLang EAGLE3 checkpoint format).

Every weight is re-drawn from a seeded generator at a scale larger than transformers' default init: default init gives
logits so close together that a greedy argmax could be decided by float rounding, and parity tests compare argmaxes.
The global torch RNG is left untouched, so writing a checkpoint does not change the random stream of the test.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.helpers.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, write_tokenizer

PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)
BOS_TOKEN_ID = SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)

# With hidden 64, a weight std of 0.1 gives projections of roughly unit scale and logits a few units apart.
WEIGHT_STD = 0.1
# Norm weights near 1, but not exactly 1, so that a norm whose weight is skipped or misapplied changes the output.
NORM_WEIGHT_NOISE_STD = 0.1
# The shard size is chosen so that a sharded target has at least this many files.
MINIMUM_SHARD_COUNT = 3

TargetFamily = Literal["llama", "qwen2", "qwen3"]

# Which transformers classes build each family; the bool says whether the family's config carries head_dim
# explicitly (Qwen3 does; Llama derives it; real Qwen2 configs have none).
FAMILY_CLASSES: dict[TargetFamily, tuple[Callable[..., PretrainedConfig], type[PreTrainedModel], bool]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, False),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, False),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, True),
}


@dataclass(frozen=True)
class TinyTargetSpec:
    family: TargetFamily = "llama"
    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    # Extra rope fields in Hugging Face form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None means plain rope.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    # Several safetensors files plus model.safetensors.index.json.
    sharded: bool = False
    # model.norm.weight = 0 makes every logit 0, so the greedy argmax is token id 0.
    zero_final_norm: bool = False
    seed: int = 0


@dataclass(frozen=True)
class TinyEagle3Spec:
    # Draft hidden size; None means the target's. A different size makes the config carry target_hidden_size.
    hidden_size: int | None = None
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    # None means hidden_size // num_heads.
    head_dim: int | None = None
    # None means len(d2t) when d2t is given, else the target vocab (then every d2t offset is 0).
    draft_vocab_size: int | None = None
    # Explicit d2t offsets, written as given (so that tests can also build malformed heads). None means draft id i
    # maps to the i-th smallest id of a seeded random subset of the target vocab that contains id 0.
    d2t: Sequence[int] | None = None
    # None writes no layer ids at all, so a loader must fall back to its defaults.
    layer_ids: Sequence[int] | None = None
    layer_ids_location: Literal["eagle_config", "top_level"] = "eagle_config"
    # Number of target aux hidden states concatenated into fc. None means len(layer_ids), else 3, and writes no
    # num_aux_hidden_states key; a number is written as num_aux_hidden_states.
    num_aux: int | None = None
    weight_prefix: Literal["midlayer", "layers.0"] = "midlayer"
    # One RMSNorm per aux chunk, fc_norm.{i}.weight, with config key "fc_norm".
    fc_norm: bool = False
    # With fc_norm: the older names aux_norm_low/mid/high.weight and config key "use_aux_norm" (needs 3 aux states).
    legacy_aux_norm_names: bool = False
    # One RMSNorm over the whole aux concatenation, before fc.
    norm_before_fc: bool = False
    norm_output: bool = False
    # Write embed_tokens.weight: the target's table when the draft is as wide as the target, else a seeded random
    # table of the draft's width (a head narrower than its target always ships its own).
    include_embedding: bool = False
    # norm.weight = 0 makes every draft logit 0, so the draft argmax is draft id 0, i.e. target id 0 + d2t[0].
    zero_final_norm: bool = False
    # False leaves d2t and t2d out of the checkpoint, as full-vocabulary heads ship (needs the full draft vocabulary).
    write_vocab_map: bool = True
    # Plain rope of this base instead of the target's rope (a target rope a Llama head cannot take, e.g. Gemma 4's).
    rope_theta: float | None = None
    # The head's rms_norm_eps; None means the target's.
    rms_norm_eps: float | None = None
    # Writes "scale_embeddings": true (embedding rows times sqrt(hidden) before input_layernorm).
    scale_embeddings: bool = False
    seed: int = 0


def write_tiny_target(directory: Path, spec: TinyTargetSpec = TinyTargetSpec()) -> Path:
    """Writes a randomly initialised target model with its tokenizer into directory and returns directory."""
    config_class, model_class, explicit_head_dim = FAMILY_CLASSES[spec.family]
    family_fields: dict[str, Any] = {"head_dim": spec.hidden_size // spec.num_heads} if explicit_head_dim else {}
    config = config_class(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        # A copy, because transformers adds rope_theta to the dict it is given and the spec must stay as written.
        rope_scaling=dict(spec.rope_scaling) if spec.rope_scaling is not None else None,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        dtype="float32",
        **family_fields,
    )
    # The constructor's own init draws from the global RNG; fork it so the caller's random stream is unchanged.
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    redraw_parameters(model, torch.Generator().manual_seed(spec.seed))
    if spec.zero_final_norm:
        with torch.no_grad():
            model.get_decoder().norm.weight.zero_()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )

    directory.mkdir(parents=True, exist_ok=True)
    if spec.sharded:
        total_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
        # At the default sizes every tensor is well under a quarter of the total, so a quarter-sized shard limit
        # gives >= 3 files; a spec where one tensor dominates is caught by the check below.
        model.save_pretrained(
            directory, safe_serialization=True, max_shard_size=total_bytes // (MINIMUM_SHARD_COUNT + 1)
        )
        shard_count = len(list(directory.glob("model-*-of-*.safetensors")))
        if not (directory / "model.safetensors.index.json").is_file() or shard_count < MINIMUM_SHARD_COUNT:
            raise RuntimeError(f"expected a sharded checkpoint with >= {MINIMUM_SHARD_COUNT} files, got {shard_count}")
    else:
        model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory, spec.vocab_size)
    return directory


def write_tiny_eagle3(directory: Path, target_dir: Path, spec: TinyEagle3Spec = TinyEagle3Spec()) -> Path:
    """Writes an EAGLE3 draft head for the target in target_dir into directory and returns directory."""
    target_config = json.loads((target_dir / "config.json").read_text())
    target_vocab = target_config["vocab_size"]
    target_hidden = target_config["hidden_size"]
    hidden = spec.hidden_size if spec.hidden_size is not None else target_hidden
    head_dim = spec.head_dim if spec.head_dim is not None else hidden // spec.num_heads
    num_aux = resolve_num_aux(spec)
    validate_eagle3_spec(spec, num_aux)
    generator = torch.Generator().manual_seed(spec.seed)

    if spec.d2t is not None:
        offsets = list(spec.d2t)
    else:
        draft_vocab = spec.draft_vocab_size if spec.draft_vocab_size is not None else target_vocab
        offsets = random_d2t(draft_vocab, target_vocab, generator)

    prefix = spec.weight_prefix
    attention_input = 2 * hidden  # embedding and hidden state, concatenated
    attention = {
        f"{prefix}.self_attn.q_proj.weight": dense_weight((spec.num_heads * head_dim, attention_input), generator),
        f"{prefix}.self_attn.k_proj.weight": dense_weight((spec.num_kv_heads * head_dim, attention_input), generator),
        f"{prefix}.self_attn.v_proj.weight": dense_weight((spec.num_kv_heads * head_dim, attention_input), generator),
        f"{prefix}.self_attn.o_proj.weight": dense_weight((hidden, spec.num_heads * head_dim), generator),
    }
    sizes = Eagle3HeadSizes(prefix, hidden, spec.intermediate_size, num_aux * target_hidden, target_vocab)
    tensors = attention | eagle3_head_tensors(sizes, offsets, generator)
    if spec.fc_norm:
        for name in aux_norm_names(spec, num_aux):
            tensors[name] = norm_weight((target_hidden,), generator)
    if spec.norm_before_fc:
        # REFERENCE.md does not name this weight; "norm_before_fc" is this project's choice.
        tensors["norm_before_fc.weight"] = norm_weight((num_aux * target_hidden,), generator)
    if spec.include_embedding and hidden == target_hidden:
        tensors["embed_tokens.weight"] = read_target_tensor(target_dir, "model.embed_tokens.weight")
    elif spec.include_embedding:
        # Unit scale, like a trained embedding's rows after input_layernorm.
        tensors["embed_tokens.weight"] = torch.randn((target_vocab, hidden), generator=generator)
    if spec.zero_final_norm:
        tensors["norm.weight"].zero_()
    if not spec.write_vocab_map:
        del tensors["d2t"], tensors["t2d"]

    directory.mkdir(parents=True, exist_ok=True)
    config = eagle3_config(spec, target_config, hidden, head_dim, num_aux, len(offsets))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def d2t_offsets(draft_to_target: Sequence[int]) -> list[int]:
    """The d2t offsets for a draft vocab whose draft id i is target id draft_to_target[i]."""
    return [target_id - draft_id for draft_id, target_id in enumerate(draft_to_target)]


def target_ids_of_draft(directory: Path) -> list[int]:
    """The target id of every draft id of the EAGLE3 head in directory, in draft id order."""
    offsets = load_file(str(directory / "model.safetensors"))["d2t"]  # [draft_vocab]
    return [draft_id + int(offset) for draft_id, offset in enumerate(offsets)]


def dense_weight(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * WEIGHT_STD


def norm_weight(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return 1.0 + torch.randn(shape, generator=generator) * NORM_WEIGHT_NOISE_STD


def redraw_parameters(
    model: torch.nn.Module,
    generator: torch.Generator,
    norm_center: float = 1.0,
    stds: Mapping[str, float] | None = None,
) -> None:
    """Re-draws every parameter of model from generator, in named_parameters order (which lists a tied lm_head once,
    under the embedding's name): weights of a module whose name contains "norm" as norm_center plus noise of std
    NORM_WEIGHT_NOISE_STD, a parameter whose name ends with a key of stds at that std, any other as dense_weight."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            shape = tuple(parameter.shape)
            own_std = [std for suffix, std in (stds or {}).items() if name.endswith(suffix)]
            if "norm" in name.rsplit(".", 2)[-2]:
                parameter.copy_(norm_center + torch.randn(shape, generator=generator) * NORM_WEIGHT_NOISE_STD)
            elif own_std:
                parameter.copy_(torch.randn(shape, generator=generator) * own_std[0])
            else:
                parameter.copy_(dense_weight(shape, generator))


def resolve_num_aux(spec: TinyEagle3Spec) -> int:
    if spec.num_aux is not None:
        return spec.num_aux
    if spec.layer_ids is not None:
        return len(spec.layer_ids)
    return 3


def validate_eagle3_spec(spec: TinyEagle3Spec, num_aux: int) -> None:
    if spec.layer_ids is not None and len(spec.layer_ids) != num_aux:
        raise ValueError(f"num_aux={num_aux} but {len(spec.layer_ids)} layer ids: {list(spec.layer_ids)}")
    if spec.legacy_aux_norm_names and not spec.fc_norm:
        raise ValueError("legacy_aux_norm_names renames the fc_norm weights; it needs fc_norm=True")
    if spec.legacy_aux_norm_names and num_aux != 3:
        raise ValueError(f"the legacy names aux_norm_low/mid/high need exactly 3 aux states, got {num_aux}")
    if spec.d2t is not None and spec.draft_vocab_size is not None and len(spec.d2t) != spec.draft_vocab_size:
        raise ValueError(f"draft_vocab_size={spec.draft_vocab_size} but d2t has {len(spec.d2t)} entries")
    if not spec.write_vocab_map and (spec.d2t is not None or spec.draft_vocab_size is not None):
        raise ValueError("write_vocab_map=False is a full-vocabulary head: it takes no d2t or draft_vocab_size")


def random_d2t(draft_vocab: int, target_vocab: int, generator: torch.Generator) -> list[int]:
    """Offsets for a seeded random, sorted subset of the target vocab that contains id 0 (so d2t[0] == 0)."""
    if not 1 <= draft_vocab <= target_vocab:
        raise ValueError(f"draft_vocab_size must be in [1, {target_vocab}], got {draft_vocab}")
    other_ids = torch.randperm(target_vocab - 1, generator=generator)[: draft_vocab - 1] + 1
    return d2t_offsets(sorted([0, *other_ids.tolist()]))


@dataclass(frozen=True)
class Eagle3HeadSizes:
    prefix: str  # of the decoder layer's tensors: "midlayer" or "layers.0"
    hidden: int
    intermediate_size: int
    fc_input: int  # num_aux * target hidden
    target_vocab: int


def eagle3_head_tensors(
    sizes: Eagle3HeadSizes, offsets: Sequence[int], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """An EAGLE3 head's tensors other than its attention (which differs by layer kind): the layer's dense gated MLP
    and three norms, fc, the final norm, lm_head over the draft vocabulary of the d2t offsets, d2t and t2d. Offsets
    that point outside the target vocabulary are written to d2t as given and left out of t2d."""
    prefix, hidden, intermediate = sizes.prefix, sizes.hidden, sizes.intermediate_size
    in_vocab_target_ids = [
        draft_id + offset for draft_id, offset in enumerate(offsets) if 0 <= draft_id + offset < sizes.target_vocab
    ]
    draft_in_target_vocab = torch.zeros(sizes.target_vocab, dtype=torch.bool)
    draft_in_target_vocab[in_vocab_target_ids] = True
    return {
        f"{prefix}.mlp.gate_proj.weight": dense_weight((intermediate, hidden), generator),
        f"{prefix}.mlp.up_proj.weight": dense_weight((intermediate, hidden), generator),
        f"{prefix}.mlp.down_proj.weight": dense_weight((hidden, intermediate), generator),
        f"{prefix}.input_layernorm.weight": norm_weight((hidden,), generator),
        f"{prefix}.hidden_norm.weight": norm_weight((hidden,), generator),
        f"{prefix}.post_attention_layernorm.weight": norm_weight((hidden,), generator),
        "fc.weight": dense_weight((hidden, sizes.fc_input), generator),
        "norm.weight": norm_weight((hidden,), generator),
        "lm_head.weight": dense_weight((len(offsets), hidden), generator),
        "d2t": torch.tensor(list(offsets), dtype=torch.int64),
        "t2d": draft_in_target_vocab,
    }


def aux_norm_names(spec: TinyEagle3Spec, num_aux: int) -> list[str]:
    if spec.legacy_aux_norm_names:
        return ["aux_norm_low.weight", "aux_norm_mid.weight", "aux_norm_high.weight"]
    return [f"fc_norm.{index}.weight" for index in range(num_aux)]


def target_rope(target_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The target's (rope_theta, rope_scaling), from transformers 5's rope_parameters or the older top-level keys."""
    if "rope_parameters" not in target_config:
        return target_config["rope_theta"], target_config.get("rope_scaling")
    parameters = target_config["rope_parameters"]
    if "full_attention" in parameters:  # per layer type (Gemma3): a head takes the global layers' rope
        parameters = parameters["full_attention"]
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    plain_rope = scaling in ({}, {"rope_type": "default"})
    return parameters["rope_theta"], None if plain_rope else scaling


def eagle3_config(
    spec: TinyEagle3Spec, target_config: dict[str, Any], hidden: int, head_dim: int, num_aux: int, draft_vocab: int
) -> dict[str, Any]:
    rope_theta, rope_scaling = target_rope(target_config) if spec.rope_theta is None else (spec.rope_theta, None)
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True, "norm_before_fc": spec.norm_before_fc}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": hidden,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target_config["rms_norm_eps"] if spec.rms_norm_eps is None else spec.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": target_config["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "pad_token_id": target_config.get("pad_token_id"),
        "torch_dtype": "float32",
        "eagle_config": eagle_config,
    }
    if hidden != target_config["hidden_size"]:
        config["target_hidden_size"] = target_config["hidden_size"]
    if spec.num_aux is not None:
        config["num_aux_hidden_states"] = num_aux
    if spec.layer_ids is not None:
        location = eagle_config if spec.layer_ids_location == "eagle_config" else config
        location["eagle_aux_hidden_state_layer_ids"] = list(spec.layer_ids)
    if spec.fc_norm:
        config["use_aux_norm" if spec.legacy_aux_norm_names else "fc_norm"] = True
    if spec.norm_output:
        config["norm_output"] = True
    if spec.scale_embeddings:
        config["scale_embeddings"] = True
    return config


def read_target_tensor(target_dir: Path, name: str) -> torch.Tensor:
    """One tensor of the target, from a single model.safetensors or from the shard the index names for it."""
    index_path = target_dir / "model.safetensors.index.json"
    weight_map = json.loads(index_path.read_text())["weight_map"] if index_path.is_file() else {}
    with safe_open(str(target_dir / weight_map.get(name, "model.safetensors")), framework="pt") as checkpoint:
        return checkpoint.get_tensor(name)


def main() -> None:
    """`python -m tests.helpers.checkpoints DIR`: a random tiny target (DIR/target) and EAGLE3 head (DIR/eagle3)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    target = write_tiny_target(args.directory / "target", TinyTargetSpec(num_layers=6))
    write_tiny_eagle3(args.directory / "eagle3", target, TinyEagle3Spec(layer_ids=(1, 3, 5), draft_vocab_size=200))
    print(f"wrote {args.directory}/target and {args.directory}/eagle3")


if __name__ == "__main__":
    main()
