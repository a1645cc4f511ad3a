"""Which target layers feed an EAGLE3 draft: layer ids from the draft config -> capture indices.

Capture index i is the residual stream entering target layer i; index num_layers is the final
stream before the final norm. Draft configs name layers in one of two conventions, and applying the
wrong one silently ruins acceptance, so the convention is resolved explicitly and logged:
- "output": ids name the layer whose OUTPUT is captured (SpecForge training, first id usually 1);
  capture index = id + 1. Example: ids [1, 15, 28] on 32 layers -> indices [2, 16, 29].
- "input": ids already are capture indices (vLLM; first id usually 2).
- "auto": "output" when the first id is 1, else "input" (the rule SGLang applies to DeepSeek-V2 drafts).
With no ids at all the default input set (2, L // 2, L - 3) is used and a loud warning is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tandem.errors import StartupError

LOG = logging.getLogger(__name__)

Convention = Literal["auto", "output", "input"]
CONVENTIONS: tuple[Convention, ...] = ("auto", "output", "input")


class AuxLayerError(StartupError):
    """Layer ids that the target cannot capture."""


@dataclass(frozen=True)
class CaptureSpec:
    indices: tuple[int, ...]  # capture indices in [0, num_layers], in the order the draft concatenates them
    convention: str  # "output", "input" or "default"
    layer_ids: tuple[int, ...] | None  # as written in the draft config


def default_capture_indices(num_layers: int) -> tuple[int, ...]:
    return (2, num_layers // 2, num_layers - 3)


def resolve_capture(
    layer_ids: Sequence[int] | None,
    num_layers: int,
    num_aux: int,
    convention: Convention = "auto",
    default_indices: Callable[[int], tuple[int, ...]] = default_capture_indices,
) -> CaptureSpec:
    """`default_indices` is the target family's default set (registry), used when the draft names no layers."""
    if convention not in CONVENTIONS:
        raise AuxLayerError(f"aux layer convention: {convention!r} is not one of {', '.join(CONVENTIONS)}")
    if not layer_ids:
        indices = default_indices(num_layers)
        if num_aux != len(indices):
            raise AuxLayerError(
                f"eagle_aux_hidden_state_layer_ids: missing, and the default set has {len(indices)} layers "
                f"while the draft expects {num_aux} aux hidden states"
            )
        LOG.warning(
            "!!! draft config gives no eagle_aux_hidden_state_layer_ids: capturing the DEFAULT target "
            "layer inputs %s of the target family's default set (L=%d). If the head was trained on other "
            "layers, acceptance will be poor with no other error.",
            list(indices),
            num_layers,
        )
        return _checked(CaptureSpec(indices, "default", None), num_layers)
    ids = tuple(int(i) for i in layer_ids)
    if len(ids) != num_aux:
        raise AuxLayerError(
            f"eagle_aux_hidden_state_layer_ids: {len(ids)} ids {list(ids)}, but the draft's fc expects "
            f"{num_aux} aux hidden states"
        )
    resolved = convention if convention != "auto" else ("output" if ids[0] == 1 else "input")
    offset = 1 if resolved == "output" else 0
    spec = CaptureSpec(tuple(i + offset for i in ids), resolved, ids)
    LOG.info(
        "aux layer ids %s read as %s-of-layer (convention %s) -> capture indices %s of %d target layers",
        list(ids),
        resolved,
        convention,
        list(spec.indices),
        num_layers,
    )
    return _checked(spec, num_layers)


def _checked(spec: CaptureSpec, num_layers: int) -> CaptureSpec:
    for index in spec.indices:
        if not 0 <= index <= num_layers:
            written = f" (layer ids {list(spec.layer_ids)} read as {spec.convention})" if spec.layer_ids else ""
            raise AuxLayerError(
                f"aux capture index {index}{written} is outside the target's range 0..{num_layers} "
                f"(the target has {num_layers} layers)"
            )
    return spec
