"""Writes trained modules as checkpoint tensors: the inverse of tandem.weights.loader's name mapping.

Packed parameters (qkv_proj, gate_up_proj, MLA's fused_qkv_a_proj_with_mqa) are split back into their checkpoint
parts (q_proj, k_proj, ..., q_a_proj, kv_a_proj_with_mqa) by the packing of the loader's NameMap for the model, and
parameter prefixes are renamed to checkpoint prefixes, so the loader that serves the files reads them back as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tandem.layers.linear import PackedLinear
from tandem.weights.loader import PACKED_PARTS


def checkpoint_tensors(
    module: nn.Module,
    renames: tuple[tuple[str, str], ...] = (),  # (parameter prefix, checkpoint prefix), first match wins
    dtype: torch.dtype = torch.bfloat16,  # floating tensors are stored in this dtype; integer buffers keep theirs
    packed: Mapping[str, tuple[str, str]] = PACKED_PARTS,  # the loader's NameMap.packed for this model
) -> dict[str, torch.Tensor]:
    # (packed module, part) -> checkpoint module name, e.g. ("qkv_proj", "q") -> "q_proj".
    unpacked_names = {packed_part: checkpoint for checkpoint, packed_part in packed.items()}
    modules = dict(module.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    # remove_duplicate keeps a tied lm_head out: it is stored once, under the embedding's name.
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name]
        pieces: list[tuple[str, torch.Tensor]]
        if isinstance(owner, PackedLinear):
            parent, _, packed_name = owner_name.rpartition(".")
            pieces = [
                (f"{parent}.{unpacked_names[(packed_name, part)]}.{leaf}", tensor.detach().narrow(0, start, size))
                for part, (start, size) in owner.part_rows.items()
            ]
        else:
            pieces = [(name, tensor.detach())]
        for piece_name, piece in pieces:
            stored = piece.to(dtype) if piece.is_floating_point() else piece
            tensors[_renamed(piece_name, renames)] = stored.contiguous().clone()
    return tensors


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    # safetensors creates the file readable by its owner only; shipped as package data it must be readable by all.
    path.chmod(0o644)
    return path


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for source, target in renames:
        if name.startswith(source):
            return target + name[len(source) :]
    return name
