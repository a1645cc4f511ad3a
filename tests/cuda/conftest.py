"""The GPU suite: every test here is marked `cuda` and skipped, with the reason, where torch sees no CUDA device.

None of it has run yet (no GPU was available where it was written): docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
