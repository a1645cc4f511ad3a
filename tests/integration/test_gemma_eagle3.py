"""An EAGLE3 head on a Gemma 4 target through `tandem serve`: greedy speculative output == target-only output ==
transformers' greedy, token for token.

The target is the tiny random Gemma 4 of tests.helpers.gemma4_checkpoints ("dense": per-layer inputs, KV-shared
layers, K=V full layers, a softcap); the head is random, full-vocabulary (no d2t or t2d), with one aux norm per
chunk, no embedding of its own (it pulls the target's raw table over GetWeights), and output-of-layer ids [1, 3, 5]
whose last one is the target's last layer (capture index 6 of 6 layers: the stream before the final norm).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import TinyEagle3Spec, write_tiny_eagle3
from tests.helpers.gemma4_checkpoints import SPECS, write_tiny_gemma4
from tests.integration.stack import draft_info, generate, serve, service_addresses

PROMPTS = [[5, 17, 42, 99, 7, 250, 31], [2, 300, 12, 12, 64]]
NEW_TOKENS = 20
NUM_STEPS = 3


def transformers_greedy(target: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            output = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                eos_token_id=None,
            )
        outputs.append([int(token) for token in output[0, len(prompt) :]])
    return outputs


def test_eagle3_head_on_gemma4_gives_target_only_output(tmp_path: Path) -> None:
    target = write_tiny_gemma4(tmp_path / "target", SPECS["dense"])
    spec = TinyEagle3Spec(layer_ids=(1, 3, 5), fc_norm=True, write_vocab_map=False, rope_theta=10_000.0, seed=2)
    head = write_tiny_eagle3(tmp_path / "head", target, spec)
    expected = transformers_greedy(target, PROMPTS)
    with serve(target, head, "--speculative-num-steps", str(NUM_STEPS)) as stack:
        requests = [{"input_ids": prompt, "max_new_tokens": NEW_TOKENS, "ignore_eos": True} for prompt in PROMPTS]
        speculative = [generate(stack.address, **request) for request in requests]
        target_only = [generate(stack.address, **request, disable_speculation=True) for request in requests]
        info = draft_info(service_addresses(stack.log)["draft"])
        log = list(stack.log)
    assert [completion.token_ids for completion in target_only] == expected
    assert [completion.token_ids for completion in speculative] == expected
    assert all(completion.stats.draft_tokens > 0 for completion in speculative)
    assert list(info.capture_indices) == [2, 4, 6]
    assert any("the full vocabulary" in line and "the target's raw table, pulled" in line for line in log)
