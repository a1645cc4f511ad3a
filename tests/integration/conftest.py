"""Checkpoints shared by the integration tests, written once per session as real HF directories."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import SharedStacks

NUM_LAYERS = 6
# The intra-op threads of every service these tests start (and of what those start): one. Two workers run stacks
# of three or four processes side by side on two cores; at a thread per core each (PyTorch's default), OpenMP's
# parallel regions wait on threads that are not running, and the same modules took 180 s on two workers instead of
# 125 s. Threads by default are tests/unit/test_cpu_quota.py's and test_model_thread.py's; a user's own
# OMP_NUM_THREADS is kept.
SERVICE_THREADS = "1"


@pytest.fixture(scope="module", autouse=True)
def one_thread_a_service() -> Iterator[None]:
    """OMP_NUM_THREADS for the processes a module starts; this process's own torch has its threads already."""
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", SERVICE_THREADS))
        yield


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
