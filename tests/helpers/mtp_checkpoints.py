"""Tiny chained MTP draft checkpoints in the target-checkpoint format of tandem.models.mtp.

`write_tiny_chained_mtp` writes N chained MTP layers for a tiny Llama target written by tests.helpers.checkpoints: a
directory with the target's config.json plus num_nextn_predict_layers, holding only model.layers.{L+i}.*. An MTP
layer's own tensors (mtp_own_tensors) and its zeroed copies of the shared tables (layer_copies) also serve the
DeepSeek-V3 NextN layers of tests.helpers.deepseek_checkpoints.

Weights are seeded and as large as in tests.helpers.checkpoints (argmaxes a few units apart, not near-ties).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import dense_weight, norm_weight


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
    """One MTP layer's copies of the shared tables, as DeepSeek stores them, filled with zeros."""
    return {
        prefix + "embed_tokens.weight": torch.zeros(vocab, hidden),
        prefix + "shared_head.head.weight": torch.zeros(vocab, hidden),
    }


def write_tiny_chained_mtp(directory: Path, target_dir: Path, spec: TinyChainedMTPSpec = TinyChainedMTPSpec()) -> Path:
    """MTP layers for the Llama-family target in target_dir: each decoder layer has the tensors of the target's layer
    0 (so Qwen2 biases and Qwen3 q/k norms come along), freshly drawn, plus the MTP layer's own tensors."""
    target_config: dict[str, Any] = json.loads((target_dir / "config.json").read_text())
    num_layers, hidden, vocab = (
        target_config["num_hidden_layers"],
        target_config["hidden_size"],
        target_config["vocab_size"],
    )
    first_layer = {
        name.removeprefix("model.layers.0."): tensor.shape
        for name, tensor in load_file(str(target_dir / "model.safetensors")).items()
        if name.startswith("model.layers.0.")
    }
    generator = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(spec.num_mtp_layers):
        prefix = f"model.layers.{num_layers + index}."
        for name, shape in sorted(first_layer.items()):
            draw = norm_weight if "norm" in name.rsplit(".", 2)[-2] else dense_weight
            tensors[prefix + name] = draw(tuple(shape), generator)
        tensors |= mtp_own_tensors(prefix, hidden, generator)
    if spec.include_layer_copies:
        tensors |= layer_copies(prefix, vocab, hidden)
    if spec.include_shared_tables:
        target = load_file(str(target_dir / "model.safetensors"))
        tensors |= {name: target[name] for name in ("model.embed_tokens.weight", "lm_head.weight") if name in target}
    directory.mkdir(parents=True, exist_ok=True)
    config = target_config | {"num_nextn_predict_layers": spec.num_mtp_layers}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
