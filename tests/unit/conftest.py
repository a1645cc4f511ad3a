"""Shared settings for the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread: the tensors here are tiny, and on a shared 2-core machine two threads contending with
    other processes made the model tests 3 to 4 times slower than one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
