"""Every tensor the step path creates names its device: the runners work with PyTorch's default device set to `meta`.

A tensor created without `device=` would land on the meta device under `torch.device("meta")` and fail at its first
use with a real one (or when read back), so each runner's step run under it must give exactly what it gives
normally. Models and runners are built outside the context, as a service builds them before serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from draft_server.mtp_runner import MTPRunner
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers.kv_cache import SequenceKV
from tandem.models.eagle3 import load_eagle3
from tandem.models.mtp import load_mtp
from tandem.models.registry import TargetModel, load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.eager_recorder import EagerGraphs
from tests.helpers.eagle3_mla_checkpoints import write_tiny_eagle3_mla
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from tests.helpers.parity import make_cache

CACHE = KVCacheSettings(num_blocks=64, block_size=4)
# Decode-shaped steps from recorded shapes (tandem.layers.cuda_graphs), replayed eagerly: padding and static buffers
# create tensors too.
GRAPHED = KVCacheSettings(num_blocks=64, block_size=4, cuda_graphs=True)
PROMPT = [1, 40, 41, 42, 43, 44, 45]
HIDDEN = 64
Result = TypeVar("Result")


def meta_default() -> AbstractContextManager[object]:
    return torch.device("meta")


def same_under_meta(run: Callable[[Callable[[], AbstractContextManager[object]]], Result]) -> Result:
    """Runs `run` with the default device unchanged and with it set to meta; both must give the same result."""
    expected = run(nullcontext)
    assert run(meta_default) == expected
    return expected


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture(scope="module")
def target(target_dir: Path) -> TargetModel:
    return load_target(target_dir)


@pytest.mark.parametrize("cache", [CACHE, GRAPHED], ids=["eager", "graphed"])
def test_target_step(target: TargetModel, cache: KVCacheSettings) -> None:
    def run(context: Callable[[], AbstractContextManager[object]]) -> list[object]:
        runner = TargetRunner(target, cache, max_context=64, graphs=EagerGraphs())
        with context():
            first = runner.prefill("a", PROMPT, SamplingParams(), (1, 2))
            verified = runner.verify("a", [5, 6, 7])
            sampled = runner.prefill("b", PROMPT, SamplingParams(temperature=0.8, seed=3), ())
            sampled_verify = runner.verify("b", [5, 6])
        assert first.captured is not None
        features = first.captured.features
        tokens = [first.new_tokens, verified.new_tokens, sampled.new_tokens, sampled_verify.new_tokens]
        return [*tokens, features.device.type, features.sum().item()]

    same_under_meta(run)


def test_tree_plan_and_keep(target: TargetModel) -> None:
    def run(context: Callable[[], AbstractContextManager[object]]) -> list[object]:
        cache, sequence = make_cache(target), SequenceKV()
        with context():
            with torch.no_grad():
                target(torch.tensor(PROMPT, device="cpu"), cache.plan([(sequence, len(PROMPT))]), cache)
                metadata = cache.plan([(sequence, 4)], parents=[[-1, 0, 0, 1]])
                output = target(torch.tensor([5, 6, 7, 8], device="cpu"), metadata, cache)
            cache.keep(sequence, [len(PROMPT) + 2])
        return [output.normed.sum().item(), sequence.length]

    same_under_meta(run)


def rows(start: int, length: int, width: int, seed: int) -> TargetRows:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(3, 320, (length,), generator=generator, device="cpu").tolist()
    return TargetRows(start, tokens, torch.randn(length, width, generator=generator, device="cpu"))


def proposals(runner: DraftRunner | MTPRunner, width: int, steps: int) -> Iterator[list[list[int]]]:
    yield runner.propose([ProposeInput("a", rows(0, 6, width, seed=1), steps)])
    yield runner.propose(
        [ProposeInput("a", rows(6, 2, width, seed=2), steps), ProposeInput("b", rows(0, 3, width, seed=3), steps - 1)]
    )


@pytest.mark.parametrize("cache", [CACHE, GRAPHED], ids=["eager", "graphed"])
@pytest.mark.parametrize("attention", ["llama", "mla"])
def test_eagle3_propose(target_dir: Path, tmp_path: Path, attention: str, cache: KVCacheSettings) -> None:
    if attention == "mla":
        directory = write_tiny_eagle3_mla(tmp_path, target_dir)
    else:
        spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
        directory = write_tiny_eagle3(tmp_path, target_dir, spec)
    model, has_embedding = load_eagle3(directory)
    assert has_embedding

    def run(context: Callable[[], AbstractContextManager[object]]) -> list[list[list[int]]]:
        runner = DraftRunner(model, cache, graphs=EagerGraphs())
        with context():
            return list(proposals(runner, 3 * HIDDEN, steps=3))

    same_under_meta(run)


def test_chained_mtp_propose(target_dir: Path, target: TargetModel, tmp_path: Path) -> None:
    spec = TinyChainedMTPSpec(num_mtp_layers=2, include_shared_tables=True)
    loaded = load_mtp(write_tiny_chained_mtp(tmp_path, target_dir, spec))

    def run(context: Callable[[], AbstractContextManager[object]]) -> list[list[list[int]]]:
        runner = MTPRunner(loaded.model, CACHE, chain=True)
        with context():
            return list(proposals(runner, HIDDEN, steps=2))

    same_under_meta(run)
