"""Training the demo's DFlash block drafter (training.dflash) on tiny shapes: the dense training forward gives the
logits the serving BlockRunner computes for the same block, the saved files are z-lab's layout and load with
load_dflash, and a few steps reduce the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from draft_server.block_runner import BlockRunner
from draft_server.runner import ProposeInput, TargetRows
from tandem.models.dflash import load_dflash
from tandem.settings import KVCacheSettings
from tests.unit.test_training import TINY_TARGET, saved_target, target_config, tokenizer  # noqa: F401 - fixtures
from training.dense import target_forward
from training.dflash import DFlashShape, block_logits, build_dflash, save_dflash, train_dflash
from training.eagle3 import DraftTraining, collect_draft_data
from training.target import OptimiserSettings, load_llama_target

TINY_DFLASH = DFlashShape(
    num_layers=2, intermediate_size=48, num_heads=4, num_kv_heads=2, block_size=4, target_layer_ids=(0, 1, 2)
)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def saved_draft(saved_target: Path, target_config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    target = load_llama_target(saved_target)
    hf_config = TINY_DFLASH.hf_config(target_config, mask_token_id=1)
    directory = tmp_path_factory.mktemp("dflash")
    save_dflash(build_dflash(hf_config, target, seed=0), hf_config, directory)
    return directory


def test_saved_files_are_the_z_lab_layout(saved_draft: Path) -> None:
    with safe_open(str(saved_draft / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(name.startswith(("embed_tokens", "lm_head", "model.")) for name in names)
    model, missing = load_dflash(saved_draft)
    assert model.config.capture_indices(3) == (1, 2, 4) and missing == ("embed_tokens", "lm_head")


def test_dense_block_logits_equal_the_block_runner(saved_target: Path, saved_draft: Path) -> None:  # noqa: F811
    target = load_llama_target(saved_target)
    draft, _ = load_dflash(saved_draft)
    draft.fill_table("embed_tokens", target.model.embed_tokens.weight.detach())
    draft.fill_table("lm_head", target.lm_head.weight.detach())
    capture = draft.config.capture_indices(TINY_TARGET.num_layers)
    tokens = torch.randint(3, TINY_TARGET.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        output = target_forward(target, tokens, capture)
        features = torch.cat([output.captured[index] for index in capture], dim=-1)  # [1, 12, 3 * hidden]
        dense = block_logits(draft, features, tokens, torch.tensor([5, 8]))  # [1, 2, 3, vocab]
    recorded: list[torch.Tensor] = []
    hook = draft.register_forward_hook(lambda module, args, hidden: recorded.append(draft.logits(hidden)))
    runner = BlockRunner(draft, KVCacheSettings(num_blocks=16, block_size=4))
    # Round one: positions 0..4 are context, x5 the anchor; round two: positions 5..7 added, x8 the anchor.
    for start, end in ((0, 5), (5, 8)):
        rows = TargetRows(start, tokens[0, start + 1 : end + 1].tolist(), features[0, start:end])
        runner.propose([ProposeInput("a", rows, num_steps=3)])
    hook.remove()
    for index in range(2):
        assert (dense[0, index] - recorded[index]).abs().max().item() <= TOLERANCE


def test_training_reduces_the_loss(saved_target: Path, target_config: dict[str, Any]) -> None:  # noqa: F811
    target = load_llama_target(saved_target)
    hf_config = TINY_DFLASH.hf_config(target_config, mask_token_id=1)
    model = build_dflash(hf_config, target, seed=0)
    capture = model.config.capture_indices(TINY_TARGET.num_layers)
    prompts = torch.randint(3, TINY_TARGET.vocab_size, (16, 4), generator=torch.Generator().manual_seed(3))
    data = collect_draft_data(target, prompts, num_new=12, capture=capture, batch_size=8, bf16_autocast=False)
    embedding = model.embed_tokens.weight.clone()
    settings = DraftTraining(
        epochs=15, batch_size=8, num_steps=3, optimiser=OptimiserSettings(1e-2, warmup_steps=2), bf16_autocast=False
    )
    record = train_dflash(model, data, data.features, 4, 4, settings)
    assert record.steps_done == 30
    # The target's LM head, frozen and at its initial small scale, keeps the softmax flat (the first loss is 3
    # positions' weighted ln 300); what the draft learns shows in its argmax: from none right to a third.
    assert record.curve[-1].loss < record.curve[0].loss - 0.5
    assert len(record.step_accuracy) == 3 and record.step_accuracy[0] > 0.25
    assert torch.equal(model.embed_tokens.weight, embedding)  # the target's table stays frozen
