"""The CUDA path against the CPU path on tiny random checkpoints: the same greedy tokens, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.models.eagle3 import load_eagle3
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target

pytestmark = pytest.mark.cuda

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]
CACHE = KVCacheSettings(num_blocks=64, block_size=4, attention_backend="torch")


def greedy_run(runner: TargetRunner, drafts: list[list[int]]) -> list[tuple[int, list[int], list[float]]]:
    """Prefill, then one verification per draft list: (accepted, new tokens, a checksum of the captured rows)."""
    results = [runner.prefill("a", PROMPT, SamplingParams(), (1, 2))]
    results += [runner.verify("a", tokens) for tokens in drafts]
    return [
        (
            result.accepted,
            result.new_tokens,
            [] if result.captured is None else result.captured.features.sum(1).tolist(),
        )
        for result in results
    ]


def test_target_greedy_tokens_equal_on_cuda_and_cpu(tmp_path: Path) -> None:
    directory = write_tiny_target(tmp_path, TinyTargetSpec())
    cpu = TargetRunner(load_target(directory), CACHE, max_context=128)
    cuda = TargetRunner(load_target(directory, device="cuda:0"), CACHE, max_context=128)
    assert cuda.batched_verify and cuda.device.type == "cuda"
    decoder = TargetRunner(load_target(directory), CACHE, max_context=128)
    decoder.prefill("a", PROMPT, SamplingParams())
    continuation = [decoder.verify("a").new_tokens[0] for _ in range(4)]
    drafts = [[], continuation[1:3], [7, 8, 9]]  # none, (probably) right ones, wrong ones
    expected = greedy_run(cpu, drafts)
    got = greedy_run(cuda, drafts)
    assert [(accepted, tokens) for accepted, tokens, _ in got] == [(a, t) for a, t, _ in expected]
    for (_, _, rows), (_, _, expected_rows) in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(rows), torch.tensor(expected_rows), rtol=1e-4, atol=1e-3)


def test_eagle3_proposals_equal_on_cuda_and_cpu(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    directory = write_tiny_eagle3(tmp_path / "draft", target, spec)
    generator = torch.Generator(device="cpu").manual_seed(0)
    features = torch.randn(6, 3 * 64, generator=generator, device="cpu")
    rows = TargetRows(0, [5, 6, 7, 8, 9, 10], features)
    proposals = []
    for device in ("cpu", "cuda:0"):
        model, _ = load_eagle3(directory, device=device)
        runner = DraftRunner(model, CACHE)
        proposals.append(runner.propose([ProposeInput("a", rows, 4)]))
    assert proposals[0] == proposals[1]
