"""An EAGLE3 MLA head (Eagle3DeepseekV2ForCausalLM) serving a DeepSeek-V3 target through the real stack: greedy
speculative output == target-only output == transformers generate.

The draft has the target's width and no embedding of its own, so it pulls the target's over GetWeights; its
output-of-layer ids (1, 2, 3) resolve to capture indices (2, 3, 4), the last being the final pre-norm stream.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_deepseek_target, write_tiny_eagle3_mla
from tests.integration.stack import draft_info, generate, serve, service_addresses

PROMPTS = ["def fibonacci(n):", "The quick brown fox"]
MAX_NEW_TOKENS = 16
NUM_STEPS = 3


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek_target(tmp_path_factory.mktemp("deepseek-target"))


def reference_greedy(target: Path, prompt: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    model.generation_config.eos_token_id = None  # the requests below set ignore_eos
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0)
    return [int(t) for t in output[0, input_ids.shape[1] :]]


def test_mla_draft_matches_target_only_and_transformers(deepseek_target: Path, tmp_path: Path) -> None:
    spec = TinyEagle3MLASpec(hidden_size=64, include_embedding=False, layer_ids=(1, 2, 3), draft_vocab_size=200)
    draft = write_tiny_eagle3_mla(tmp_path / "draft", deepseek_target, spec)
    expected = [reference_greedy(deepseek_target, prompt) for prompt in PROMPTS]
    with serve(deepseek_target, draft, "--speculative-num-steps", str(NUM_STEPS)) as stack:
        speculative = [
            generate(stack.address, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for prompt in PROMPTS
        ]
        target_only = [
            generate(
                stack.address, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, disable_speculation=True
            ).token_ids
            for prompt in PROMPTS
        ]
        assert list(draft_info(service_addresses(stack.log)["draft"]).capture_indices) == [2, 3, 4]
    assert target_only == expected
    assert [completion.token_ids for completion in speculative] == expected
    # The draft really proposed in every round (a random head is rarely accepted, which greedy output must not show).
    for completion in speculative:
        assert completion.stats.draft_tokens > 0
        assert completion.stats.draft_tokens >= completion.stats.rounds
