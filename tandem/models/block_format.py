"""Where a block drafter's checkpoint keeps its facts, read without torch (the launcher reads them too: `tandem
serve` sets a block drafter's default draft length before any model is loaded).

DFlash (z-lab, `DFlashDraftModel`) keeps `mask_token_id`, `target_layer_ids` and maybe `block_size` in
`dflash_config`, `block_size` otherwise at the top level, and drafts B - 1 tokens a round (block rows 1 ..), as does
DFlash2 (z-lab, `DFlash2DraftModel`, with its convolution and selector fields there too); DSpark (DeepSpec,
`Qwen3DSparkModel`) keeps them at the top level of a copy of the target's config and drafts B (rows 0 ..).
"""

from __future__ import annotations

from typing import Any

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel",)
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)
BLOCK_ARCHITECTURES = DFLASH_ARCHITECTURES + DFLASH2_ARCHITECTURES + DSPARK_ARCHITECTURES
# What each is called in messages; its lower case is the kind a replica reports (GetInfo).
BLOCK_NAMES = {
    **dict.fromkeys(DFLASH_ARCHITECTURES, "DFlash"),
    **dict.fromkeys(DFLASH2_ARCHITECTURES, "DFlash2"),
    **dict.fromkeys(DSPARK_ARCHITECTURES, "DSpark"),
}


def architecture_name(hf: dict[str, Any]) -> str:
    return str((hf.get("architectures") or ["?"])[0])


def block_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The mapping that holds the block drafter's own fields (mask token, layer ids, maybe the block size)."""
    return hf if architecture_name(hf) in DSPARK_ARCHITECTURES else hf.get("dflash_config") or {}


def draft_value(hf: dict[str, Any], name: str, default: Any = None) -> Any:
    """A block drafter's field: from the mapping of its own fields, else the top level, else `default` (z-lab reads
    every DFlash field so)."""
    return block_fields(hf).get(name, hf.get(name, default))


def block_size_of(hf: dict[str, Any]) -> Any:
    """The config's block size as written (None when absent)."""
    return draft_value(hf, "block_size")


def drafts_per_round(hf: dict[str, Any]) -> int | None:
    """What one forward of a block drafter of this config drafts; None for a config that is no block drafter's (or
    gives no block size)."""
    architecture, block_size = architecture_name(hf), block_size_of(hf)
    if architecture not in BLOCK_ARCHITECTURES or not block_size:
        return None
    return int(block_size) - (0 if architecture in DSPARK_ARCHITECTURES else 1)
