"""Every draft kind on the target family it belongs to, through the real stack (`tandem serve`): greedy speculative
output == target-only output, the draft really proposes, and it subscribes with the capture it needs.

- Gemma3 target + EAGLE3 head (no layer ids: Gemma3's default set [2, L // 2, L - 2]);
- DeepSeek-V3 target + EAGLE3 MLA head (Eagle3DeepseekV2ForCausalLM) of the target's width and no embedding of its
  own, so it pulls the target's over GetWeights; its output-of-layer ids (1, 2, 3) resolve to capture indices (2, 3,
  4), the last being the final pre-norm stream; its output also equals transformers' greedy generate;
- DeepSeek-V3 target + a Llama-layer EAGLE3 head (ids (1, 2, 3) -> (2, 3, 4)), and Qwen3 target + chained MTP: the
  same kinds on another family;
- DeepSeek-V3 target + its own NextN layer (the draft directory IS the target's), both feedback choices, fed the
  target's post-final-norm hidden (capture index L + 1);
- Llama target + a 3-layer chained MTP head, chain and independent modes, fed the final pre-norm stream (index L);
  its directory holds only the MTP layers, so the draft pulls the target's embedding and LM head over GetWeights
  (at tp 2 as two vocab-parallel shards each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.deepseek_checkpoints import DEEPSEEK_NEXTN, TinyDeepseekSpec, write_tiny_deepseek
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from tests.integration.stack import draft_info, generate, serve, service_addresses
from tests.integration.test_greedy_equivalence import reference_greedy

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os"]
MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class Case:
    target: Path
    draft: Path
    options: Sequence[str]
    kind: str
    capture: list[int]


@pytest.fixture(scope="module")
def gemma3_eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), TinyGemma3Spec())
    draft = write_tiny_eagle3(tmp_path_factory.mktemp("gemma3-eagle3"), target, TinyEagle3Spec(draft_vocab_size=200))
    return target, draft


@pytest.fixture(scope="module")
def deepseek_eagle3_mla(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_deepseek(tmp_path_factory.mktemp("deepseek"), TinyDeepseekSpec(num_layers=4))
    spec = TinyEagle3MLASpec(hidden_size=64, include_embedding=False, layer_ids=(1, 2, 3), draft_vocab_size=200)
    return target, write_tiny_eagle3_mla(tmp_path_factory.mktemp("deepseek-eagle3-mla"), target, spec)


@pytest.fixture(scope="module")
def deepseek_nextn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("deepseek-nextn"), DEEPSEEK_NEXTN)


@pytest.fixture(scope="module")
def llama_chained_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_target(tmp_path_factory.mktemp("llama"), TinyTargetSpec(family="llama", num_layers=4))
    draft = write_tiny_chained_mtp(tmp_path_factory.mktemp("chained-mtp"), target, TinyChainedMTPSpec())
    return target, draft


def check_case(case: Case) -> list[list[int]]:
    """Serves the case and checks it; returns the target-only output of every prompt."""
    with serve(case.target, case.draft, *case.options) as stack:
        speculative = [
            generate(stack.address, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for prompt in PROMPTS
        ]
        target_only = [
            generate(
                stack.address, prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, disable_speculation=True
            ).token_ids
            for prompt in PROMPTS
        ]
        info = draft_info(service_addresses(stack.log)["draft"])
    assert (info.kind, list(info.capture_indices)) == (case.kind, case.capture)
    assert [completion.token_ids for completion in speculative] == target_only
    assert all(len(tokens) == MAX_NEW_TOKENS for tokens in target_only)
    for completion in speculative:
        assert completion.stats.draft_tokens >= completion.stats.rounds > 0
    return target_only


def test_gemma3_target_with_eagle3_head(gemma3_eagle3: tuple[Path, Path]) -> None:
    target, draft = gemma3_eagle3
    check_case(Case(target, draft, ("--speculative-num-steps", "3"), "eagle3", [2, 2, 2]))


def test_deepseek_v3_target_with_eagle3_mla_head(deepseek_eagle3_mla: tuple[Path, Path]) -> None:
    target, draft = deepseek_eagle3_mla
    target_only = check_case(Case(target, draft, ("--speculative-num-steps", "3"), "eagle3", [2, 3, 4]))
    assert target_only == [reference_greedy(target, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]


@pytest.mark.parametrize("feedback", ["post_norm", "pre_norm"])
def test_deepseek_v3_target_with_its_nextn_layer(deepseek_nextn: Path, feedback: str) -> None:
    options = ("--speculative-num-steps", "3", "--mtp-feedback", feedback)
    check_case(Case(deepseek_nextn, deepseek_nextn, options, "nextn", [DEEPSEEK_NEXTN.num_layers + 1]))


@pytest.mark.parametrize(("mode", "tp"), [("chain", 1), ("independent", 1), ("chain", 2)])
def test_llama_target_with_chained_mtp(llama_chained_mtp: tuple[Path, Path], mode: str, tp: int) -> None:
    # At tp 2 the draft reassembles the embedding and LM head from the two ranks' vocab-parallel shards.
    target, draft = llama_chained_mtp
    options = ("--speculative-num-steps", "3", "--mtp-mode", mode, "--tp", str(tp))
    check_case(Case(target, draft, options, "chained-mtp", [4]))


def test_deepseek_v3_target_with_llama_layer_eagle3_head(
    deepseek_eagle3_mla: tuple[Path, Path], tmp_path: Path
) -> None:
    target, _ = deepseek_eagle3_mla
    spec = TinyEagle3Spec(layer_ids=(1, 2, 3), draft_vocab_size=200, seed=2)
    draft = write_tiny_eagle3(tmp_path / "eagle3", target, spec)
    check_case(Case(target, draft, ("--speculative-num-steps", "3"), "eagle3", [2, 3, 4]))


def test_qwen3_target_with_chained_mtp(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "qwen3", TinyTargetSpec(family="qwen3", num_layers=3))
    draft = write_tiny_chained_mtp(tmp_path / "mtp", target, TinyChainedMTPSpec(num_mtp_layers=2))
    check_case(Case(target, draft, ("--speculative-num-steps", "2"), "chained-mtp", [3]))
