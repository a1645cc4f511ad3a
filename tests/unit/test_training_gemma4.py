"""Training Gemma 4's pair (training.gemma4_target, training.served_data, training.assistant) on tiny random models:
the data the served target gives equals transformers' greedy continuation and hidden states, the assistant's
unrolled training chain equals the replica's model run round by round (the training-time test), and what the
trainers save is read back by Tandem's loaders and transformers alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM, PreTrainedTokenizerFast
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from tandem.models.gemma4_assistant import load_assistant
from tandem.models.registry import TargetModel, load_target
from tandem.settings import DEMO_TARGET
from tests.helpers.gemma4_checkpoints import SPECS, write_tiny_gemma4
from training.assistant import (
    AssistantShape,
    assistant_capture,
    build_assistant,
    chain_tokens,
    save_assistant,
    split_rows,
    unrolled_assistant_logits,
)
from training.eagle3 import IGNORED_LABEL, DraftData
from training.gemma4_target import Gemma4Shape, build_gemma4_target, gemma4_loss, save_gemma4_target
from training.served_data import served_greedy
from training.target import OptimiserSettings, TargetTraining, train_target

PROMPTS = torch.tensor([[2, 17, 45, 99, 5, 230], [77, 138, 48, 115, 170, 240]])
NEW = 20  # past the tiny target's window (8)
STEPS = 3
PAD = 0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4") / "target", SPECS["dense"])


@pytest.fixture(scope="module")
def collected(target_dir: Path) -> tuple[TargetModel, DraftData]:
    target = load_target(target_dir)
    return target, served_greedy(target, PROMPTS, NEW, assistant_capture(target))


def test_the_served_targets_continuations_are_transformers_greedy_ones(
    target_dir: Path, collected: tuple[TargetModel, DraftData]
) -> None:
    _, data = collected
    assert data.tokens.shape == (2, PROMPTS.shape[1] + NEW)
    assert torch.equal(data.tokens[:, : PROMPTS.shape[1]], PROMPTS)
    reference = Gemma4ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        output = reference(data.tokens, output_hidden_states=True)
    assert torch.equal(output.logits.argmax(dim=-1), data.argmax)
    assert torch.equal(data.tokens[:, PROMPTS.shape[1] :], data.argmax[:, PROMPTS.shape[1] - 1 : -1])
    hidden = data.features[..., : reference.config.hidden_size].float()
    torch.testing.assert_close(hidden, output.hidden_states[-1], atol=2e-2, rtol=2e-2)  # stored in bf16


def test_the_unrolled_chain_is_the_assistants_round_at_every_anchor(
    target_dir: Path, collected: tuple[TargetModel, DraftData]
) -> None:
    target, data = collected
    kept = target.kept_kv
    hf = AssistantShape(hidden_size=32, intermediate_size=48, num_heads=2).hf_config(
        json.loads((target_dir / "config.json").read_text()), kept
    )
    model = build_assistant(hf, target.model.embed_tokens.weight.detach(), seed=3).eval()
    features = data.features.float()
    hidden, kv = split_rows(features, model, kept)
    step_tokens, step_labels = chain_tokens(data, torch.arange(2), STEPS, PAD)
    assert torch.equal(step_labels[1][:, :-2], data.argmax[:, 2:]) and (step_labels[1][:, -2:] == IGNORED_LABEL).all()
    with torch.no_grad():
        unrolled = unrolled_assistant_logits(model, step_tokens, hidden, kv)
        for anchor in (2, 9, 17, 24):  # before and past the sliding window
            rows = [
                {
                    layer.sliding: (kv[layer.sliding][0][b, : anchor + 1], kv[layer.sliding][1][b, : anchor + 1])
                    for layer in kept
                }
                for b in range(2)
            ]
            state = hidden[:, anchor]
            for step in range(STEPS):
                tokens = step_tokens[step][:, anchor]
                logits, state = model(tokens, state, torch.full((2,), anchor + 1), rows)
                torch.testing.assert_close(unrolled[step][:, anchor], logits, atol=1e-4, rtol=1e-4)


def test_a_trained_assistant_is_read_back_by_tandem_and_transformers(
    tmp_path: Path, target_dir: Path, collected: tuple[TargetModel, DraftData]
) -> None:
    target = collected[0]
    hf = AssistantShape(hidden_size=32, intermediate_size=48, num_heads=2).hf_config(
        json.loads((target_dir / "config.json").read_text()), target.kept_kv
    )
    model = build_assistant(hf, target.model.embed_tokens.weight.detach(), seed=3)
    save_assistant(model, hf, tmp_path / "assistant")
    _, info = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "assistant", output_loading_info=True)
    assert not any(info.values()), info
    loaded = load_assistant(tmp_path / "assistant")
    saved = {name: tensor.bfloat16().float() for name, tensor in model.state_dict().items()}
    for name, tensor in loaded.state_dict().items():
        if name != "target_embed.weight":
            assert torch.equal(tensor, saved[name]), name


def test_a_trained_gemma4_target_serves_as_transformers_runs_it(tmp_path: Path) -> None:
    shape = Gemma4Shape(
        hidden_size=64,
        intermediate_size=96,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        num_global_kv_heads=1,
        global_head_dim=32,
        sliding_window=8,
    )
    model = build_gemma4_target(shape.hf_config(4096, 0, 1), seed=0)
    blocks = torch.randint(2, 4096, (4, 17), generator=torch.Generator().manual_seed(0))
    settings = TargetTraining(steps=2, batch_size=2, optimiser=OptimiserSettings(1e-3, 1), bf16_autocast=False)
    record = train_target(model, blocks, blocks[:2], settings, loss_of=gemma4_loss)
    assert record.steps_done == 2
    save_gemma4_target(model, PreTrainedTokenizerFast.from_pretrained(DEMO_TARGET), tmp_path / "target")
    served = load_target(tmp_path / "target")
    data = served_greedy(served, blocks[:2, :6], 12, ())
    reference = Gemma4ForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(reference(data.tokens).logits.argmax(dim=-1), data.argmax)
