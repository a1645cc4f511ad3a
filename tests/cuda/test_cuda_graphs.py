"""CUDA graphs (`--cuda-graphs`, tandem.layers.cuda_graphs) replay what the same runner computes eagerly on CUDA:
the same greedy tokens for the target's decodes and verifications and for the draft's steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_server.runner import DraftRunner, ProposeInput
from tandem.devices import flashinfer_installed
from tandem.models.eagle3 import load_eagle3
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.target_rows import random_rows

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed (pip install 'tandem[cuda]')"),
]

EAGER = KVCacheSettings(num_blocks=64, block_size=16, attention_backend="flashinfer")
GRAPHED = KVCacheSettings(num_blocks=64, block_size=16, attention_backend="flashinfer", cuda_graphs=True)
# head_dim 128, one FlashInfer is built for
SPEC = TinyTargetSpec(hidden_size=512, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=4)
PROMPTS = {"a": [1, 40, 41, 42, 43, 44, 45], "b": [1, 50, 51], "c": [1, 60, 61, 62, 63, 64, 65, 66, 67, 68]}


def rounds(runner: TargetRunner) -> list[list[tuple[int, list[int]]]]:
    steps = [[runner.prefill(i, prompt, SamplingParams(), (1, 2)) for i, prompt in PROMPTS.items()]]
    for drafts in ([5, 6, 7], [8, 9]):
        steps.append(runner.step([StepItem(i, 1, DraftTree.chain(drafts)) for i in PROMPTS]))
        steps.append(runner.step([StepItem(i, 1, decode_steps=4) for i in PROMPTS]))
    return [[(result.accepted, result.new_tokens) for result in step] for step in steps]


def test_target_replays_the_tokens_it_computes_eagerly(tmp_path: Path) -> None:
    directory = write_tiny_target(tmp_path, SPEC)
    eager = TargetRunner(load_target(directory, torch.bfloat16, "cuda:0"), EAGER, max_context=128)
    graphed = TargetRunner(load_target(directory, torch.bfloat16, "cuda:0"), GRAPHED, max_context=128)
    assert graphed.graphs is not None
    assert rounds(graphed) == rounds(eager)


def test_draft_replays_the_proposals_it_computes_eagerly(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", SPEC)
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    directory = write_tiny_eagle3(tmp_path / "draft", target, spec)
    batch = [
        ProposeInput("a", random_rows(0, 6, seed=1, width=3 * 512), 5),
        ProposeInput("b", random_rows(0, 9, seed=2, width=3 * 512), 5),
    ]
    proposals = []
    for cache in (EAGER, GRAPHED):
        model, _ = load_eagle3(directory, torch.bfloat16, "cuda:0")
        proposals.append([DraftRunner(model, cache).propose(batch) for _ in range(2)])
    assert proposals[0] == proposals[1]
