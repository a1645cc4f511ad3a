"""A tp-2 target on two GPUs (NCCL) through the real stack gives the greedy tokens of the CPU target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.integration.stack import generate, serve

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for tp 2"),
]


def test_tp2_on_two_gpus_matches_the_cpu(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path, TinyTargetSpec(num_heads=4, num_kv_heads=2))
    completions = []
    for flags in (("--device", "cpu"), ("--device", "cuda", "--tp", "2", "--dtype", "float32")):
        with serve(target, None, *flags) as stack:
            completions.append(generate(stack.address, prompt="def f(x):", max_new_tokens=24, ignore_eos=True))
    assert completions[1].token_ids == completions[0].token_ids
