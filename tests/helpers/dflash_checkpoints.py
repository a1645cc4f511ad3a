"""Tiny block drafters, DFlash and DFlash2 in z-lab's checkpoint layouts and DSpark in DeepSpec's, for a tiny target
written by tests.helpers.checkpoints.

The decoder layers come from transformers' own Qwen3Model (the backbone z-lab's DFlashDraftModel is built of): its
state dict gives `layers.N.*` and `norm.weight` without the `model.` prefix, as DFlash checkpoints store them; `fc`
and `hidden_norm` are added, and the embedding is left out (a DFlash draft uses its target's). config.json is the
Qwen3 config plus `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3Model

from tests.helpers.checkpoints import dense_weight, norm_weight, read_target_tensor, redraw_parameters


@dataclass(frozen=True)
class TinyDFlashSpec:
    num_layers: int = 2
    block_size: int = 4
    block_size_location: Literal["top_level", "dflash_config"] = "top_level"
    mask_token_id: int | None = None  # None: the target's last id
    target_layer_ids: Sequence[int] | None = (0, 2, 3)  # None: none written (derived from num_target_layers)
    layer_types: Sequence[str] | None = ("sliding_attention", "full_attention")
    sliding_window: int = 6  # small, so that the window cuts into a test's context
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 96
    hidden_size: int | None = None  # None: the target's
    vocab_size: int | None = None  # None: the target's
    num_target_layers: int | None = None  # None: the target's
    # norm.weight = 0 makes every draft logit 0, so every draft is token 0 (the target's argmax when its own final
    # norm is zero too: every draft accepted)
    zero_final_norm: bool = False
    # More dflash_config fields, e.g. (("input_embedding_scale", 8.0),) as a Gemma target's drafter carries
    dflash_fields: tuple[tuple[str, float], ...] = ()
    seed: int = 0


def write_tiny_dflash(directory: Path, target_dir: Path, spec: TinyDFlashSpec = TinyDFlashSpec()) -> Path:
    """Writes a randomly initialised DFlash draft for the target in target_dir into directory; returns directory."""
    target = json.loads((target_dir / "config.json").read_text())
    hidden = spec.hidden_size or target["hidden_size"]
    vocab = spec.vocab_size or target["vocab_size"]
    num_target_layers = spec.num_target_layers or target["num_hidden_layers"]
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=hidden // spec.num_heads,
        max_position_embeddings=target.get("max_position_embeddings", 512),
        rope_theta=10000.0,
        layer_types=list(spec.layer_types) if spec.layer_types is not None else None,
        sliding_window=spec.sliding_window,
        use_sliding_window=True,
        dtype="float32",
    )
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = backbone_tensors(config, generator)
    if spec.zero_final_norm:
        tensors["norm.weight"] = torch.zeros_like(tensors["norm.weight"])
    num_features = len(spec.target_layer_ids) if spec.target_layer_ids is not None else spec.num_layers
    tensors["fc.weight"] = dense_weight((hidden, num_features * hidden), generator) / num_features**0.5
    tensors["hidden_norm.weight"] = norm_weight((hidden,), generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dflash_config(config, spec, vocab, num_target_layers), indent=2))
    return directory


def backbone_tensors(config: Qwen3Config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The decoder layers and final norm of transformers' Qwen3Model of `config`, redrawn from `generator`, under
    their names without the `model.` prefix; no embedding."""
    with torch.random.fork_rng(devices=[]):  # the constructor's init draws from the global RNG
        backbone = Qwen3Model(config)
    redraw_parameters(backbone, generator)
    return {name: t.contiguous() for name, t in backbone.state_dict().items() if not name.startswith("embed_")}


def dflash_config(config: Qwen3Config, spec: TinyDFlashSpec, vocab: int, num_target_layers: int) -> dict[str, Any]:
    written = config.to_dict()
    dflash: dict[str, Any] = {"mask_token_id": vocab - 1 if spec.mask_token_id is None else spec.mask_token_id}
    if spec.target_layer_ids is not None:
        dflash["target_layer_ids"] = list(spec.target_layer_ids)
    dflash.update(spec.dflash_fields)
    if spec.block_size_location == "dflash_config":
        dflash["block_size"] = spec.block_size
    else:
        written["block_size"] = spec.block_size
    written.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_target_layers=num_target_layers,
        dflash_config=dflash,
    )
    return written


@dataclass(frozen=True)
class TinyDSparkSpec:
    """A DSpark draft in DeepSpec's layout: a copy of the target's (Qwen3) config with the draft's layer count and
    DSpark's fields at the top level, weights without a `model.` prefix, the target's embedding and LM head copied in
    (`include_tables`) as DeepSpec's trainer saves them."""

    num_layers: int = 2
    block_size: int = 4  # DSpark drafts from every row: 4 drafts a round
    target_layer_ids: Sequence[int] = (-1, 1, 3)  # -1: the embedding's output
    markov_rank: int = 8  # 0: no Markov head
    markov_head_type: Literal["vanilla", "gated"] = "vanilla"
    confidence_head: bool = True
    confidence_with_markov: bool = True
    include_tables: bool = True
    zero_final_norm: bool = False  # as TinyDFlashSpec's: every draft token 0 (with no Markov head)
    confidence_bias: float | None = None  # the confidence head's bias (None: random); on zero rows, every score
    seed: int = 0


def write_tiny_dspark(directory: Path, target_dir: Path, spec: TinyDSparkSpec = TinyDSparkSpec()) -> Path:
    target = json.loads((target_dir / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    fields = {key: target[key] for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")}
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=target["intermediate_size"],
        num_hidden_layers=spec.num_layers,
        max_position_embeddings=target["max_position_embeddings"],
        rope_theta=10000.0,
        dtype="float32",
        **fields,
    )
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = backbone_tensors(config, generator)
    if spec.zero_final_norm:
        tensors["norm.weight"] = torch.zeros_like(tensors["norm.weight"])
    if spec.include_tables:
        tensors["embed_tokens.weight"] = read_target_tensor(target_dir, "model.embed_tokens.weight")
        tensors["lm_head.weight"] = read_target_tensor(target_dir, "lm_head.weight")
    tensors["fc.weight"] = dense_weight((hidden, len(spec.target_layer_ids) * hidden), generator)
    tensors["hidden_norm.weight"] = norm_weight((hidden,), generator)
    rank = spec.markov_rank
    if rank:
        tensors["markov_head.markov_w1.weight"] = dense_weight((vocab, rank), generator) * 10
        tensors["markov_head.markov_w2.weight"] = dense_weight((vocab, rank), generator)
        if spec.markov_head_type == "gated":
            tensors["markov_head.gate_proj.weight"] = dense_weight((rank, hidden + rank), generator)
            tensors["markov_head.gate_proj.bias"] = dense_weight((rank,), generator)
    if spec.confidence_head:
        width = hidden + (rank if spec.confidence_with_markov else 0)
        tensors["confidence_head.proj.weight"] = dense_weight((1, width), generator)
        tensors["confidence_head.proj.bias"] = dense_weight((1,), generator)
        if spec.confidence_bias is not None:
            tensors["confidence_head.proj.bias"] = torch.full((1,), spec.confidence_bias)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    written = config.to_dict() | {
        "architectures": ["Qwen3DSparkModel"],
        "num_target_layers": target["num_hidden_layers"],
        "block_size": spec.block_size,
        "tie_word_embeddings": False,
        "mask_token_id": vocab - 1,
        "target_layer_ids": list(spec.target_layer_ids),
        "num_anchors": 512,
        "enable_confidence_head": spec.confidence_head,
        "confidence_head_with_markov": spec.confidence_with_markov,
        "markov_rank": rank,
        "markov_head_type": spec.markov_head_type,
    }
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    return directory


@dataclass(frozen=True)
class TinyDFlash2Spec:
    """A DFlash2 draft in z-lab's layout: a DFlash draft (`dflash`) with a dynamic convolution around each sublayer
    (`layers.N.{attention,mlp}_conv.base_kernel` [2, taps, hidden] and `.kernel_projection.weight`) and a candidate
    selector (`candidate_selector.{predecessor,successor}_codebook` [vocab, rank], `.hidden_projection.weight`), its
    fields in `dflash_config` and `architectures: ["DFlash2DraftModel"]`."""

    dflash: TinyDFlashSpec = TinyDFlashSpec()
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 8
    selector_top_k: int = 4
    # The codebooks' scale: large enough that the transition score reorders a row's candidates.
    codebook_scale: float = 7.0


def write_tiny_dflash2(directory: Path, target_dir: Path, spec: TinyDFlash2Spec = TinyDFlash2Spec()) -> Path:
    write_tiny_dflash(directory, target_dir, spec.dflash)
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    hidden, vocab, taps = config["hidden_size"], config["vocab_size"], spec.conv_kernel_size
    generator = torch.Generator().manual_seed(spec.dflash.seed + 100)
    for layer in range(spec.dflash.num_layers):
        for sublayer in ("attention_conv", "mlp_conv"):
            base = dense_weight((2, taps, hidden), generator) * 3
            base[:, 0] += 1.0  # near the identity at tap 0, as z-lab initialises it
            tensors[f"layers.{layer}.{sublayer}.base_kernel"] = base
            width = 2 * taps * (hidden // spec.conv_group_size)
            tensors[f"layers.{layer}.{sublayer}.kernel_projection.weight"] = dense_weight((width, hidden), generator)
    rank = spec.selector_rank
    for book in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{book}"] = dense_weight((vocab, rank), generator) * spec.codebook_scale
    tensors["candidate_selector.hidden_projection.weight"] = dense_weight((rank, hidden), generator)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    config["dflash_config"].update({name: getattr(spec, name) for name in fields})
    config["architectures"] = ["DFlash2DraftModel"]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
