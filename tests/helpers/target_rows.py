"""Random target rows for draft tests: what the target's hidden-state stream would hand a replica."""

from __future__ import annotations

import torch

from draft_server.runner import TargetRows
from tests.helpers.checkpoints import TinyTargetSpec

# Three captured layers of the tiny target (tests.helpers.checkpoints.TinyTargetSpec), concatenated.
TINY_FEATURE_WIDTH = 3 * TinyTargetSpec().hidden_size


def random_rows(start_position: int, length: int, seed: int, width: int = TINY_FEATURE_WIDTH) -> TargetRows:
    """`length` rows from `start_position`: random next tokens (ids 3..319) and features, reproducible by seed."""
    generator = torch.Generator().manual_seed(seed)
    return TargetRows(
        start_position=start_position,
        next_tokens=torch.randint(3, 320, (length,), generator=generator).tolist(),
        features=torch.randn(length, width, generator=generator),
    )
