"""Training the demo's block drafters (training.dflash: DFlash, and DSpark with its Markov and confidence heads) on
tiny shapes: the dense training forward gives the logits (and confidences) the serving BlockRunner computes for the
same block, the saved files are z-lab's (DeepSpec's) layout and load with load_dflash, and a few steps reduce the
loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from draft_server.block_runner import BlockRunner
from draft_server.runner import ProposeInput, TargetRows
from tandem.models.dflash import DFlashDraft, load_dflash
from tandem.settings import KVCacheSettings
from tests.unit.test_training import TINY_TARGET, saved_target, target_config, tokenizer  # noqa: F401 - fixtures
from training.dense import target_forward
from training.dflash import (
    DFlashShape,
    DSparkShape,
    block_hidden,
    block_logits,
    build_dflash,
    save_dflash,
    train_dflash,
)
from training.eagle3 import DraftTraining, collect_draft_data
from training.target import OptimiserSettings, load_llama_target

TINY_DFLASH = DFlashShape(
    num_layers=2, intermediate_size=48, num_heads=4, num_kv_heads=2, block_size=4, target_layer_ids=(0, 1, 2)
)
TINY_DSPARK = DSparkShape(
    num_layers=2,
    intermediate_size=48,
    num_heads=4,
    num_kv_heads=2,
    block_size=3,
    target_layer_ids=(0, 1, 2),
    markov_rank=8,
)
SHAPES = {"dflash": TINY_DFLASH, "dspark": TINY_DSPARK}
TOLERANCE = 1e-4


# A Gemma target's drafter (the same tiny Llama target, its config read as a Gemma's) scales the table's rows by
# sqrt(hidden) and softcaps the logits, as the target does inside (training.dflash.gemma_fields).
GEMMA_TARGET = {"model_type": "gemma4_text", "final_logit_softcapping": 3.0}


@pytest.fixture(scope="module", params=[*SHAPES, "dflash-gemma"])
def saved_draft(
    request: pytest.FixtureRequest,
    saved_target: Path,  # noqa: F811
    target_config: dict[str, Any],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    target = load_llama_target(saved_target)
    gemma = request.param == "dflash-gemma"
    shape = TINY_DFLASH if gemma else SHAPES[request.param]
    hf_config = shape.hf_config(target_config | (GEMMA_TARGET if gemma else {}), mask_token_id=1)
    directory = tmp_path_factory.mktemp(request.param)
    model = build_dflash(hf_config, target, seed=0)
    if model.markov_head is not None:  # drawn at N(0, 0.02) the correction is too small to show in a test
        model.markov_head.markov_w1.weight.data.mul_(50.0)
    save_dflash(model, hf_config, directory)
    return directory


def test_saved_files_are_the_z_lab_layout(saved_draft: Path) -> None:
    with safe_open(str(saved_draft / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert not any(name.startswith(("embed_tokens", "lm_head", "model.")) for name in names)
    model, missing = load_dflash(saved_draft)
    assert model.config.capture_indices(3) == (1, 2, 4) and missing == ("embed_tokens", "lm_head")
    gemma = saved_draft.name.startswith("dflash-gemma")
    assert model.config.embedding_scale == (TINY_TARGET.hidden_size**0.5 if gemma else 1.0)
    assert model.config.logit_softcap == (3.0 if gemma else None)
    if model.config.dspark is not None:
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= names
        assert model.config.drafts_per_block == 3


def test_dense_block_logits_equal_the_block_runner(saved_target: Path, saved_draft: Path) -> None:  # noqa: F811
    target = load_llama_target(saved_target)
    draft, _ = load_dflash(saved_draft)
    draft.fill_table("embed_tokens", target.model.embed_tokens.weight.detach())
    draft.fill_table("lm_head", target.lm_head.weight.detach())
    capture = draft.config.capture_indices(TINY_TARGET.num_layers)
    tokens = torch.randint(3, TINY_TARGET.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([5, 8])
    with torch.no_grad():
        output = target_forward(target, tokens, capture)
        features = torch.cat([output.captured[index] for index in capture], dim=-1)  # [1, 12, 3 * hidden]
        dense = block_logits(draft, features, tokens, anchors)  # [1, 2, 3, vocab]
        hidden = block_hidden(draft, features, tokens, anchors)
    recorded: list[torch.Tensor] = []
    hook = draft.register_forward_hook(lambda module, args, rows: recorded.append(rows))
    runner = BlockRunner(draft, KVCacheSettings(num_blocks=16, block_size=4))
    # Round one: positions 0..4 are context, x5 the anchor; round two: positions 5..7 added, x8 the anchor. The
    # tokens before the drafts are the sequence's (DSpark's Markov head reads them): the runner's drafts differ, so
    # its rows' logits are taken here with the same tokens before them.
    for index, (start, end) in enumerate(((0, 5), (5, 8))):
        rows = TargetRows(start, tokens[0, start + 1 : end + 1].tolist(), features[0, start:end])
        runner.propose([ProposeInput("a", rows, num_steps=3)])
        previous = tokens[0, anchors[index] + torch.arange(3)]
        check_round(draft, dense[0, index], hidden[0, index], recorded[index], previous)
    hook.remove()


@torch.inference_mode()
def check_round(
    draft: DFlashDraft, dense: torch.Tensor, hidden: torch.Tensor, served_rows: torch.Tensor, previous: torch.Tensor
) -> None:
    """The dense forward's logits and confidences of one block equal the served rows' given the same tokens before
    each draft."""
    assert (dense - draft.logits(served_rows, previous)).abs().max().item() <= TOLERANCE
    if draft.confidence_head is not None:
        served = draft.confidence(served_rows, previous)
        assert served is not None and torch.allclose(served, draft.confidence_logits(hidden, previous).sigmoid())


@pytest.mark.parametrize("name", list(SHAPES))
def test_training_reduces_the_loss(saved_target: Path, target_config: dict[str, Any], name: str) -> None:  # noqa: F811
    target = load_llama_target(saved_target)
    hf_config = SHAPES[name].hf_config(target_config, mask_token_id=1)
    model = build_dflash(hf_config, target, seed=0)
    capture = model.config.capture_indices(TINY_TARGET.num_layers)
    prompts = torch.randint(3, TINY_TARGET.vocab_size, (16, 4), generator=torch.Generator().manual_seed(3))
    data = collect_draft_data(target, prompts, num_new=12, capture=capture, batch_size=8, bf16_autocast=False)
    embedding = model.embed_tokens.weight.clone()
    settings = DraftTraining(
        epochs=15, batch_size=8, num_steps=3, optimiser=OptimiserSettings(1e-2, warmup_steps=2), bf16_autocast=False
    )
    confidence = model.confidence_head.proj.weight.clone() if model.confidence_head is not None else None
    record = train_dflash(model, data, data.features, 4, 4, settings)
    assert record.steps_done == 30
    # The target's LM head, frozen and at its initial small scale, keeps the softmax flat (the first loss is 3
    # positions' weighted ln 300); what the draft learns shows in its argmax: from none right to a third.
    assert record.curve[-1].loss < record.curve[0].loss - 0.5
    assert len(record.step_accuracy) == 3 and record.step_accuracy[0] > 0.25
    assert torch.equal(model.embed_tokens.weight, embedding)  # the target's table stays frozen
    if model.confidence_head is not None:  # DSpark's confidence head learns too
        assert confidence is not None and not torch.equal(model.confidence_head.proj.weight, confidence)
