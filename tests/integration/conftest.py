"""Checkpoints shared by the integration tests, written once per session as real HF directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import SharedStacks

NUM_LAYERS = 6


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("llama"), TinyTargetSpec(family="llama", num_layers=NUM_LAYERS))


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory: pytest.TempPathFactory, llama_target: Path) -> Path:
    """Random EAGLE3 head, output-of-layer ids (first id 1), reduced draft vocabulary through d2t."""
    spec = TinyEagle3Spec(layer_ids=(1, 3, 5), draft_vocab_size=200, seed=1)
    return write_tiny_eagle3(tmp_path_factory.mktemp("random-draft"), llama_target, spec)


@pytest.fixture(scope="session")
def stacks() -> Iterator[SharedStacks]:
    """Running stacks shared by flag set for the whole run (of this xdist worker)."""
    shared = SharedStacks()
    yield shared
    shared.stop()
