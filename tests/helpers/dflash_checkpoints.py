"""Tiny DFlash drafts in z-lab's checkpoint layout, for a tiny target written by tests.helpers.checkpoints.

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
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3Model

from tests.helpers.checkpoints import dense_weight, norm_weight, redraw_parameters


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
    with torch.random.fork_rng(devices=[]):
        backbone = Qwen3Model(config)
    generator = torch.Generator().manual_seed(spec.seed)
    redraw_parameters(backbone, generator)
    tensors = {name: t.contiguous() for name, t in backbone.state_dict().items() if not name.startswith("embed_")}
    if spec.zero_final_norm:
        tensors["norm.weight"] = torch.zeros_like(tensors["norm.weight"])
    num_features = len(spec.target_layer_ids) if spec.target_layer_ids is not None else spec.num_layers
    tensors["fc.weight"] = dense_weight((hidden, num_features * hidden), generator) / num_features**0.5
    tensors["hidden_norm.weight"] = norm_weight((hidden,), generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(dflash_config(config, spec, vocab, num_target_layers), indent=2))
    return directory


def dflash_config(config: Qwen3Config, spec: TinyDFlashSpec, vocab: int, num_target_layers: int) -> dict[str, Any]:
    written = config.to_dict()
    dflash: dict[str, Any] = {"mask_token_id": vocab - 1 if spec.mask_token_id is None else spec.mask_token_id}
    if spec.target_layer_ids is not None:
        dflash["target_layer_ids"] = list(spec.target_layer_ids)
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
