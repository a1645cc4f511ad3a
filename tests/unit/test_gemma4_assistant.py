"""Gemma 4's assistant drafter (tandem.models.gemma4_assistant, draft_server.assistant_runner) against transformers'
Gemma4AssistantForCausalLM: the model given the same K/V rows, and the whole path (the target's K/V rows captured
by Tandem's Gemma 4 target, written into the replica's pool, drafted from) against transformers' own candidate
generation, both head kinds, with random weights (every layer's attention counts); and the start-up refusals."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import Gemma4ForCausalLM
from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

from draft_server.assistant_runner import AssistantRunner, check_assistant
from draft_server.compat import IncompatibleDraft
from draft_server.runner import DraftRequestError, ProposeInput, TargetRows
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.gemma4_assistant import load_assistant
from tandem.models.registry import TargetModel, load_target
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from tests.helpers.gemma4_assistant_checkpoints import assistant_config
from tests.helpers.gemma4_checkpoints import SPECS, redraw_gemma4, write_tiny_gemma4

TEXT = [2, 17, 45, 99, 5, 230, 77, 138, 48, 115, 170, 240, 11, 289, 177, 11, 85, 79]  # longer than the window (8)
STEPS = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("assistant")
    write_tiny_gemma4(root / "target", SPECS["dense"])
    for centroids in (False, True):
        with torch.random.fork_rng(devices=[]):
            assistant = Gemma4AssistantForCausalLM(assistant_config(SPECS["dense"], centroids)).eval()
        redraw_gemma4(assistant, seed=5)
        if centroids:
            ordering = torch.randperm(
                assistant.config.text_config.vocab_size, generator=torch.Generator().manual_seed(1)
            )
            assistant.masked_embedding.token_ordering.copy_(ordering)
        assistant.save_pretrained(root / f"assistant-{centroids}", safe_serialization=True)
    return root


def reference_drafts(target: Gemma4ForCausalLM, assistant: Gemma4AssistantForCausalLM, length: int) -> list[int]:
    """transformers' assistant loop (SinglePositionMultiTokenCandidateGenerator's) after the target ran TEXT[:length]:
    STEPS drafts at position `length`, from token TEXT[length] and the target's hidden of length - 1."""
    ids = torch.tensor([TEXT[:length]])
    with torch.no_grad():
        outputs = target(ids, output_hidden_states=True, return_shared_kv_states=True)
        hidden = outputs.hidden_states[-1][:, -1:]
        token = torch.tensor([[TEXT[length]]])
        drafts = []
        for _ in range(STEPS):
            embedded = torch.cat([target.model.embed_tokens(token), hidden], dim=-1)
            step = assistant(
                inputs_embeds=embedded,
                position_ids=torch.tensor([[length]]),
                attention_mask=torch.ones(1, length + 1, dtype=torch.long),
                shared_kv_states=outputs.shared_kv_states,
            )
            token, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
            drafts.append(int(token))
    return drafts


def info_of(target: TargetModel) -> target_pb2.TargetInfo:
    """What the target's GetInfo tells a draft about it (target_server.main.target_info), of a loaded model."""
    config = target.config
    return target_pb2.TargetInfo(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
        kept_kv=[target_pb2.KeptKV(**asdict(kept)) for kept in target.kept_kv],
    )


@pytest.mark.parametrize("centroids", [False, True], ids=["lm-head", "centroid-head"])
def test_drafts_from_the_targets_captured_rows_equal_transformers(written: Path, centroids: bool) -> None:
    target = load_target(written / "target")
    info = info_of(target)
    assistant = load_assistant(written / f"assistant-{centroids}")
    kept = check_assistant(assistant.config, info)
    assert [layer.layer for layer in kept] == [2, 3]  # the last K/V-keeping full and sliding layers
    assistant.target_embed.weight.data.copy_(target.model.embed_tokens.weight)
    indices = (info.num_layers + 1, *(info.num_layers + 2 + layer.layer for layer in kept))
    layout = target.config.cache_layout
    cache = PagedKVCache(info.num_layers, 16, 4, layout.num_kv_heads, layout.key_dim, torch.float32)
    with torch.no_grad():
        output = target(torch.tensor(TEXT), cache.plan([(SequenceKV(), len(TEXT))]), cache, indices)
    features = torch.cat([output.captured[index] for index in indices], dim=-1)
    reference_target = Gemma4ForCausalLM.from_pretrained(written / "target", dtype=torch.float32).eval()
    reference = Gemma4AssistantForCausalLM.from_pretrained(written / f"assistant-{centroids}", dtype=torch.float32)
    runner = AssistantRunner(assistant, kept, KVCacheSettings(num_blocks=16, block_size=4))
    # Rows arrive in rounds of several lengths; each round drafts from all rows so far, past the window and not.
    start = 0
    for end in (6, 7, 10, 11, 15, 17):
        rows = TargetRows(start, TEXT[start + 1 : end + 1], features[start:end])
        drafts = runner.propose([ProposeInput("r", rows, STEPS)])
        assert drafts == [reference_drafts(reference_target, reference.eval(), end)], end
        start = end - 1 if end == 10 else end  # a rejected round: the next rows start one position back
    assert runner.requests["r"].kv.length == 17
    # Rows of another width (a target that sent one rank's heads) are refused before anything changes.
    narrow = TargetRows(17, TEXT[1:2], features[:1, :-1])
    with pytest.raises(DraftRequestError, match=f"rows of {features.shape[1] - 1} values, the assistant reads"):
        runner.propose([ProposeInput("r", narrow, STEPS)])
    assert runner.requests["r"].kv.length == 17


def test_an_assistant_that_does_not_fit_is_refused_naming_both_values(written: Path) -> None:
    info = info_of(load_target(written / "target"))
    config = load_assistant(written / "assistant-False").config
    other = target_pb2.TargetInfo()
    other.CopyFrom(info)
    other.architecture = "LlamaForCausalLM"
    with pytest.raises(IncompatibleDraft, match=r"Gemma 4 targets .* the target is LlamaForCausalLM"):
        check_assistant(config, other)
    other.CopyFrom(info)
    other.hidden_size, other.vocab_size = 96, 400
    with pytest.raises(
        IncompatibleDraft,
        match=r"backbone_hidden_size: the assistant has 64, the target has 96.*"
        "vocab_size: the assistant has 320, the target has 400",
    ):
        check_assistant(config, other)
    other.CopyFrom(info)
    other.kept_kv[0].head_dim = 64
    with pytest.raises(
        IncompatibleDraft, match="full layers' K/V heads: the assistant has 2 of 32, the target's layer 2 has 2 of 64"
    ):
        check_assistant(config, other)
    del other.kept_kv[1]
    with pytest.raises(IncompatibleDraft, match="assistant layer 0 is a sliding layer, the target keeps no sliding"):
        check_assistant(config, other)
