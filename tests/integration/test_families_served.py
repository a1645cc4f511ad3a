"""The families as they ship, through `tandem serve` (real processes): greedy output equals transformers' greedy on
tiny random checkpoints written by transformers' own classes, for the multimodal and quantized checkpoints too; and
MTP layers served as the draft give transformers' `generate(use_mtp=True)` rounds and accepted counts.

The checkpoints come from the unit tests' helpers, where each family is checked layer by layer; here the question is
whether the served stack (loading, the orchestrator, the wire) gives the same tokens.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma4ForConditionalGeneration,
    Kimi_K25ForConditionalGeneration,
    PreTrainedModel,
    Step3p7ForConditionalGeneration,
)

from tests.helpers.deepseek_checkpoints import DEEPSEEK_NEXTN, TinyDeepseekSpec, write_tiny_deepseek
from tests.helpers.gemma4_checkpoints import (
    SPECS,
    write_tiny_gemma3_multimodal,
    write_tiny_gemma4,
    write_tiny_gemma4_multimodal,
)
from tests.helpers.kimi_checkpoints import to_hub_layout, write_tiny_kimi_k25
from tests.helpers.quantized_checkpoints import write_fp8, write_int4_experts
from tests.helpers.step3p5_mtp_checkpoints import (
    NUM_LAYERS,
    NUM_MTP,
    VOCAB,
    FitSpec,
    Rounds,
    add_random_mtp_layers,
    fit_mtp_layers,
    reference_post_norm,
    transformers_rounds,
    write_step3p5_target,
)
from tests.helpers.tokenizer import write_tokenizer
from tests.integration.stack import generate, serve
from tests.unit.test_step3p5 import write_hub_layout, write_step3p7

NEW_TOKENS = 16
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8]


def greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    generate_: Any = model.generate  # not typed
    with torch.no_grad():
        output = generate_(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
        )
    return [int(token) for token in output[0, len(prompt) :]]


def step3p5_hub(directory: Path) -> tuple[Path, PreTrainedModel]:
    step3p7 = directory / "step3p7"
    write_step3p7(step3p7)
    hub = write_hub_layout(directory / "hub", step3p7)
    write_tokenizer(hub, VOCAB)
    return hub, Step3p7ForConditionalGeneration.from_pretrained(step3p7, dtype=torch.float32)


def step3p7(directory: Path) -> tuple[Path, PreTrainedModel]:
    write_step3p7(directory)
    write_tokenizer(directory, VOCAB)
    return directory, Step3p7ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32)


def kimi_k25(directory: Path) -> tuple[Path, PreTrainedModel]:
    written = write_tiny_kimi_k25(directory / "saved", TinyDeepseekSpec(num_layers=3))
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(written, dtype=torch.float32)
    return to_hub_layout(Path(shutil.copytree(written, directory / "hub"))), reference


def gemma3_multimodal(directory: Path) -> tuple[Path, PreTrainedModel]:
    written = write_tiny_gemma3_multimodal(directory)
    return written, Gemma3ForConditionalGeneration.from_pretrained(written, dtype=torch.float32)


def gemma4_multimodal(directory: Path) -> tuple[Path, PreTrainedModel]:
    written = write_tiny_gemma4_multimodal(directory, SPECS["dense"])
    return written, Gemma4ForConditionalGeneration.from_pretrained(written, dtype=torch.float32)


def gemma4_moe(directory: Path) -> tuple[Path, PreTrainedModel]:
    written = write_tiny_gemma4(directory, SPECS["moe"])
    return written, AutoModelForCausalLM.from_pretrained(written, dtype=torch.float32)


def deepseek_fp8(directory: Path) -> tuple[Path, PreTrainedModel]:
    source = write_tiny_deepseek(directory / "float", TinyDeepseekSpec(num_layers=3))
    write_fp8(source, directory / "fp8", directory / "reference", (16, 24))
    return directory / "fp8", AutoModelForCausalLM.from_pretrained(directory / "reference", dtype=torch.float32)


def kimi_k25_int4(directory: Path) -> tuple[Path, PreTrainedModel]:
    source = write_tiny_kimi_k25(directory / "float", TinyDeepseekSpec(num_layers=3))
    write_int4_experts(source, directory / "int4", directory / "reference", 16)
    reference = Kimi_K25ForConditionalGeneration.from_pretrained(directory / "reference", dtype=torch.float32)
    return directory / "int4", reference


CHECKPOINTS: dict[str, Callable[[Path], tuple[Path, PreTrainedModel]]] = {
    "Step3p5ForCausalLM (hub layout)": step3p5_hub,
    "Step3p7ForConditionalGeneration": step3p7,
    "KimiK25ForConditionalGeneration (hub layout)": kimi_k25,
    "Gemma3ForConditionalGeneration": gemma3_multimodal,
    "Gemma4ForConditionalGeneration": gemma4_multimodal,
    "Gemma4ForCausalLM (MoE)": gemma4_moe,
    "DeepSeek-V3 block-wise fp8": deepseek_fp8,
    "Kimi-K2.5 INT4 experts": kimi_k25_int4,
}


@pytest.mark.parametrize(("kind", "tp"), [*((kind, 1) for kind in CHECKPOINTS), ("Gemma4ForConditionalGeneration", 2)])
def test_served_greedy_equals_transformers(tmp_path: Path, kind: str, tp: int) -> None:
    target, reference = CHECKPOINTS[kind](tmp_path)
    expected = greedy(reference.eval(), PROMPT, NEW_TOKENS)
    with serve(target, None, "--tp", str(tp)) as stack:
        served = generate(stack.address, input_ids=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert served.token_ids == expected


def fitted_step3p5(directory: Path) -> Path:
    """Step3p7 with MTP layers fitted to its own greedy text, so that drafts are accepted in some rounds only."""
    write_step3p5_target(directory)
    add_random_mtp_layers(directory, NUM_LAYERS, NUM_MTP)
    model = Step3p7ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    texts = [[*prompt, *greedy(model, prompt, 30)] for prompt in MTP_PROMPTS]
    fit_mtp_layers(directory, FitSpec(NUM_LAYERS, NUM_MTP, 0.0), texts, reference_post_norm(model, texts))
    write_tokenizer(directory, VOCAB)
    return directory


def fitted_nextn(directory: Path) -> Path:
    write_tiny_deepseek(directory, DEEPSEEK_NEXTN)
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    texts = [[*prompt, *greedy(model, prompt, 30)] for prompt in MTP_PROMPTS]
    spec = FitSpec(DEEPSEEK_NEXTN.num_layers, DEEPSEEK_NEXTN.num_nextn_layers, unit_norm=1.0)
    fit_mtp_layers(directory, spec, texts, reference_post_norm(model, texts))
    return directory


MTP_PROMPTS = [[5, 17, 42, 99, 7, 250], [12, 3, 77, 140, 9, 61]]


def step3p5_reference(directory: Path) -> PreTrainedModel:
    return Step3p7ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


def nextn_reference(directory: Path) -> PreTrainedModel:
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # transformers looks for DeepSeek-V3's MTP layer at model.layers.61 only; point it at this model's layer.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{DEEPSEEK_NEXTN.num_layers}\..*"]
    return model


def clipped(accepted: list[int], steps: int, new_tokens: int) -> list[int]:
    """transformers' accepted counts as Tandem drafts them: a round never drafts past max_new_tokens (with r tokens
    to go it drafts min(k, r - 1)), where transformers drafts k and cuts the output afterwards."""
    counts, produced = [], 1  # the prefill's token
    for count in accepted:
        counts.append(min(count, steps, new_tokens - produced - 1))
        produced += counts[-1] + 1
    return counts


def assert_served_rounds(address: str, expected: list[Rounds], target_only: list[list[int]], steps: int) -> None:
    """Each of MTP_PROMPTS served greedily for 30 tokens: the tokens equal transformers' target-only ones
    and speculative ones (`expected`), and the rounds and accepted drafts per position equal `expected`'s at a fixed k
    of `steps`."""
    served = [generate(address, input_ids=prompt, max_new_tokens=30, ignore_eos=True) for prompt in MTP_PROMPTS]
    for completion, rounds, tokens in zip(served, expected, target_only, strict=True):
        assert completion.token_ids == rounds.tokens == tokens
        accepted = clipped(rounds.accepted, steps, 30)
        produced = 1 + sum(count + 1 for count in accepted)
        assert completion.stats.rounds == len(accepted) + (produced < 30)  # a last round with no room to draft
        assert list(completion.stats.accepted_per_position) == [
            sum(count > i for count in accepted) for i in range(steps)
        ]


@pytest.mark.parametrize(
    ("write", "reference", "steps"),
    [(fitted_step3p5, step3p5_reference, NUM_MTP), (fitted_nextn, nextn_reference, 1)],
    ids=["Step-3.5 MTP", "DeepSeek-V3 NextN"],
)
def test_served_mtp_rounds_equal_transformers_use_mtp(
    tmp_path: Path,
    write: Callable[[Path], Path],
    reference: Callable[[Path], PreTrainedModel],
    steps: int,
) -> None:
    directory = write(tmp_path / "model")
    model = reference(directory)
    expected = [transformers_rounds(model, prompt, 30) for prompt in MTP_PROMPTS]
    options = ("--speculative-num-steps", str(steps), "--mtp-feedback", "post_norm", "--draft-ahead", "0")
    with serve(directory, directory, *options) as stack:
        assert_served_rounds(stack.address, expected, [greedy(model, prompt, 30) for prompt in MTP_PROMPTS], steps)
    accepted = [count for rounds in expected for count in rounds.accepted]
    assert min(accepted) < steps <= max(accepted)  # trained enough to accept, not so much that it always does
