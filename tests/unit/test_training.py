"""The demo training pipeline (training) on tiny shapes.

What is trained must be what is served: the dense training forwards are compared with the paged serving forwards
and with transformers, the saved files are read back by the serving loaders, and the unrolled draft chains of the
training-time test are compared, step by step, with the chains the runners run: DraftRunner for EAGLE3 heads of
both layer kinds (Llama, MLA), MTPRunner for chained MTP layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from draft_server.mtp_runner import MTPRunner
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.aux_layers import resolve_capture
from tandem.models.eagle3 import load_eagle3
from tandem.models.mtp import MTPLayerOutput, load_mtp
from tandem.settings import KVCacheSettings
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from training.data import (
    END_OF_TEXT,
    HELD_OUT_PACKAGES,
    PAD,
    encode_documents,
    pack_blocks,
    sample_prompts,
    split_corpus,
    stdlib_root,
    token_id,
    train_tokenizer,
)
from training.dense import chain_mask, target_forward, unrolled_draft_logits, unrolled_mtp_outputs
from training.eagle3 import (
    IGNORED_LABEL,
    DraftShape,
    DraftTraining,
    LatentAttentionShape,
    build_draft,
    captured_features,
    chain_inputs,
    collect_draft_data,
    draft_vocabulary,
    save_draft,
    target_to_draft_map,
    train_draft,
)
from training.mtp import MTPShape, build_mtp, mtp_inputs, save_mtp, train_mtp
from training.target import (
    OptimiserSettings,
    TargetShape,
    TargetTraining,
    build_target,
    greedy_generate,
    load_llama_target,
    save_target,
    train_target,
)

TOLERANCE = 1e-4
TINY_TARGET = TargetShape(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2
)
TINY_DRAFT = DraftShape(
    hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, draft_vocab_size=64, aux_layer_ids=(1, 2)
)
TINY_MLA = LatentAttentionShape(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
TINY_MLA_DRAFT = replace(TINY_DRAFT, latent_attention=TINY_MLA)
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n",
    "for index in range(10):\n    print(index * index)\n",
] * 4


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(TEXTS, TINY_TARGET.vocab_size)


@pytest.fixture(scope="module")
def target_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return TINY_TARGET.hf_config(token_id(tokenizer, END_OF_TEXT), token_id(tokenizer, PAD))


@pytest.fixture(scope="module")
def saved_target(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast, target_config: dict[str, Any]
) -> Path:
    directory = tmp_path_factory.mktemp("target")
    save_target(build_target(target_config, seed=0), target_config, tokenizer, directory)
    return directory


# Corpus.


def write_files(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x = 1\n")


def test_split_skips_tests_and_holds_out_named_packages(tmp_path: Path) -> None:
    write_files(
        tmp_path,
        [
            "argparse.py",
            "asyncio/tasks.py",
            "asyncio/tests.py",  # a module named tests, not a test folder: kept
            "json/decoder.py",
            "email/mime/text.py",
            "test/test_argparse.py",
            "unittest/test/test_case.py",
            "unittest/case.py",
            "idlelib/idle_test/test_config.py",
            "lib2to3/tests/data/fixers.py",
            "site-packages/thirdparty/module.py",
            "encodings/cp1252.py",
        ],
    )
    split = split_corpus(tmp_path, held_out=("json", "email"))
    assert [str(p.relative_to(tmp_path)) for p in split.train] == [
        "argparse.py",
        "asyncio/tasks.py",
        "asyncio/tests.py",
        "unittest/case.py",
    ]
    assert [str(p.relative_to(tmp_path)) for p in split.held_out] == ["email/mime/text.py", "json/decoder.py"]


def test_real_stdlib_split_has_no_held_out_or_test_files() -> None:
    split = split_corpus(stdlib_root())
    assert len(split.train) > 100 and len(split.held_out) > 10
    for path in split.train:
        relative = path.relative_to(split.root)
        assert split.package_of(path) not in HELD_OUT_PACKAGES, relative
        assert not {"test", "tests", "idle_test", "site-packages"} & set(relative.parts[:-1]), relative
    assert {split.package_of(path) for path in split.held_out} == set(HELD_OUT_PACKAGES)


def test_tokenizer_round_trips_code_and_prompts_stay_inside_one_document(tokenizer: PreTrainedTokenizerFast) -> None:
    code = "if x:\n\tprint('héllo')  # ünïcode\n"
    assert tokenizer.decode(tokenizer(code)["input_ids"]) == code
    end = token_id(tokenizer, END_OF_TEXT)
    stream = encode_documents(tokenizer, TEXTS)
    assert int((stream == end).sum()) == len(TEXTS)
    prompts = sample_prompts(stream, count=8, length=6, seed=0, forbidden=end)
    assert prompts.shape == (8, 6) and not bool((prompts == end).any())
    assert pack_blocks(torch.arange(10), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# Target.


def test_a_few_steps_reduce_the_loss(target_config: dict[str, Any]) -> None:
    model = build_target(target_config, seed=0)
    pattern = torch.arange(8).repeat(5)[:33]  # a periodic sequence is learnable in a few steps
    blocks = torch.stack([pattern.roll(shift) for shift in range(4)])  # [4, 33]
    settings = TargetTraining(
        steps=25, batch_size=4, block_length=32, optimiser=OptimiserSettings(1e-2, warmup_steps=2), bf16_autocast=False
    )
    record = train_target(model, blocks, blocks, settings)
    assert record.steps_done == 25
    assert record.curve[-1].loss < 0.5 * record.curve[0].loss
    assert record.held_out_loss < 0.5 * record.curve[0].loss


def test_saved_target_loads_in_transformers_and_tandem_with_equal_logits(saved_target: Path) -> None:
    ours = load_llama_target(saved_target)
    theirs = AutoModelForCausalLM.from_pretrained(saved_target, dtype=torch.float32).eval()
    token_ids = torch.randint(0, TINY_TARGET.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(token_ids).logits
        dense = ours.compute_logits(target_forward(ours, token_ids).normed)
        cache = PagedKVCache(TINY_TARGET.num_layers, 8, 4, TINY_TARGET.num_kv_heads, 8, torch.float32)
        metadata = cache.plan([(SequenceKV(), 12)])
        paged = ours.compute_logits(ours(token_ids[0], metadata, cache).normed)
    assert (dense - expected).abs().max().item() <= TOLERANCE
    assert (paged - expected[0]).abs().max().item() <= TOLERANCE


def test_greedy_generate_continues_like_recomputing_from_scratch(saved_target: Path) -> None:
    model = load_llama_target(saved_target)
    prompts = torch.randint(0, TINY_TARGET.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    tokens, argmax, features = greedy_generate(model, prompts, num_new=4, capture=(1, 3))
    assert tokens.shape == argmax.shape == (2, 9)
    with torch.no_grad():
        full = target_forward(model, tokens, capture=(1, 3))
    assert torch.equal(argmax, model.compute_logits(full.normed).argmax(dim=-1))
    assert torch.equal(tokens[:, 5:], argmax[:, 4:-1])  # every new token is the argmax at the previous position
    assert features is not None
    expected = torch.cat([full.captured[1], full.captured[3]], dim=-1).to(torch.bfloat16)
    assert (features.float() - expected.float()).abs().max().item() <= 1e-2


# EAGLE3 head.


def test_draft_vocabulary_keeps_the_most_frequent_ids_in_order() -> None:
    counts = torch.tensor([5, 0, 9, 1, 7, 0])
    draft_to_target = draft_vocabulary(counts, 3)
    assert draft_to_target.tolist() == [0, 2, 4]
    assert target_to_draft_map(draft_to_target, 6).tolist() == [0, IGNORED_LABEL, 1, IGNORED_LABEL, 2, IGNORED_LABEL]


def test_chain_inputs_follow_the_worked_example() -> None:
    tokens = torch.tensor([[10, 11, 12, 13]])  # x
    argmax = torch.tensor([[20, 21, 22, 23]])  # g
    identity = torch.arange(30)
    step_tokens, step_labels = chain_inputs(tokens, argmax, num_steps=3, target_to_draft=identity, pad_id=0)
    assert step_tokens[0].tolist() == [[11, 12, 13, 0]]  # x[p + 1]
    assert step_labels[0].tolist() == [[21, 22, 23, IGNORED_LABEL]]  # g[p + 1]
    assert step_tokens[1].tolist() == [[21, 22, 23, 0]]  # g[p + 1]
    assert step_labels[1].tolist() == [[22, 23, IGNORED_LABEL, IGNORED_LABEL]]  # g[p + 2]
    assert step_tokens[2].tolist() == [[22, 23, 0, 0]]
    assert step_labels[2].tolist() == [[23, IGNORED_LABEL, IGNORED_LABEL, IGNORED_LABEL]]
    assert chain_mask(3, 1).int().tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1]]


@pytest.mark.parametrize(
    ("shape", "architecture", "layer_prefix"),
    [
        (TINY_DRAFT, "LlamaForCausalLMEagle3", "midlayer."),
        (TINY_MLA_DRAFT, "Eagle3DeepseekV2ForCausalLM", "layers.0."),
    ],
    ids=["llama", "mla"],
)
def test_saved_head_loads_with_load_eagle3(
    saved_target: Path,
    target_config: dict[str, Any],
    tmp_path: Path,
    shape: DraftShape,
    architecture: str,
    layer_prefix: str,
) -> None:
    draft_to_target = torch.arange(0, 2 * shape.draft_vocab_size, 2)  # every other target id
    config = shape.hf_config(target_config)
    draft = build_draft(config, draft_to_target, seed=0)
    save_draft(draft, config, tmp_path)
    names = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    if shape.latent_attention is not None:  # the Kimi-K2.5 layout: separate down projections, kv_b_proj
        assert {
            f"{layer_prefix}self_attn.q_a_proj.weight",
            f"{layer_prefix}self_attn.kv_a_proj_with_mqa.weight",
        } < names
        assert f"{layer_prefix}self_attn.kv_b_proj.weight" in names
    assert f"{layer_prefix}hidden_norm.weight" in names

    loaded, has_embedding = load_eagle3(tmp_path)
    assert loaded.config.architecture == architecture
    assert has_embedding  # the draft's hidden (16) differs from the target's (32): it needs its own table
    assert loaded.config.target_hidden_size == TINY_TARGET.hidden_size
    assert loaded.config.aux_layer_ids == shape.aux_layer_ids
    capture = resolve_capture(loaded.config.aux_layer_ids, TINY_TARGET.num_layers, loaded.config.num_aux)
    assert (capture.convention, capture.indices) == ("output", (2, 3))
    target_ids = loaded.to_target_ids(torch.arange(shape.draft_vocab_size))
    assert torch.equal(target_ids, draft_to_target)
    assert int(target_ids.min()) >= 0 and int(target_ids.max()) < TINY_TARGET.vocab_size
    saved = dict(draft.named_parameters())
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, saved[name].detach().to(torch.bfloat16).float()), name


HeadWriter = Callable[[Path, Path], Path]  # (head directory, target directory) -> head directory
HEAD_WRITERS: dict[str, HeadWriter] = {
    "llama": lambda directory, target_dir: write_tiny_eagle3(
        directory,
        target_dir,
        TinyEagle3Spec(hidden_size=32, draft_vocab_size=100, layer_ids=(1, 2, 3), include_embedding=True),
    ),
    # YaRN rope, interleaved: the dense path must rotate exactly as the serving layer does.
    "mla": lambda directory, target_dir: write_tiny_eagle3_mla(
        directory, target_dir, TinyEagle3MLASpec(hidden_size=32, draft_vocab_size=100, layer_ids=(1, 2, 3))
    ),
}


@pytest.mark.parametrize("head", list(HEAD_WRITERS))
def test_unrolled_chain_matches_the_draft_runner_step_by_step(tmp_path: Path, head: str) -> None:
    """Two rounds as the servers run them: ingest rows 0..5 and draft 4 steps, then ingest rows 6..9 and draft
    4 steps. The unrolled training forward over all 10 positions must give, at the anchor of each round, the logits
    the runner computed at every step, when it is fed the tokens the runner drafted."""
    target_dir = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    draft_dir = HEAD_WRITERS[head](tmp_path / "draft", target_dir)
    target = load_llama_target(target_dir)
    draft, _ = load_eagle3(draft_dir)
    capture = resolve_capture(draft.config.aux_layer_ids, target.config.num_layers, draft.config.num_aux).indices
    tokens = torch.randint(3, 320, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        output = target_forward(target, tokens[None, :10], capture)
    features = torch.cat([output.captured[index] for index in capture], dim=-1)  # [1, 10, 3 * 64]

    recorded: list[torch.Tensor] = []
    hook = draft.register_forward_hook(lambda module, args, step: recorded.append(step.logits))
    runner = DraftRunner(draft, KVCacheSettings(num_blocks=16, block_size=4))
    rounds = [(0, 6), (6, 10)]
    proposals = []
    for start, end in rounds:
        rows = TargetRows(start, tokens[start + 1 : end + 1].tolist(), features[0, start:end])
        proposals.append(runner.propose([ProposeInput("a", rows, num_steps=4)])[0])
    hook.remove()

    for round_index, ((_, end), proposal) in enumerate(zip(rounds, proposals, strict=True)):
        anchor = end - 1
        step_tokens = [tokens[None, 1:11]]
        for drafted in proposal[:-1]:
            chain_tokens = torch.zeros(1, 10, dtype=torch.long)
            chain_tokens[0, anchor] = drafted
            step_tokens.append(chain_tokens)
        with torch.no_grad():
            unrolled = unrolled_draft_logits(draft, features, step_tokens)
        runner_steps = recorded[4 * round_index : 4 * round_index + 4]
        ingest = runner_steps[0]  # the ingest pass scores its last row only: the anchor
        assert ingest.shape[0] == 1
        assert (unrolled[0][0, anchor] - ingest[0]).abs().max().item() <= TOLERANCE
        for step in range(1, 4):
            assert (unrolled[step][0, anchor] - runner_steps[step][0]).abs().max().item() <= TOLERANCE
        drafted_again = [int(draft.to_target_ids(logits[0, anchor].argmax())) for logits in unrolled]
        assert drafted_again == proposal


def test_draft_training_reduces_the_chain_loss(saved_target: Path, target_config: dict[str, Any]) -> None:
    target = load_llama_target(saved_target)
    capture = resolve_capture(TINY_DRAFT.aux_layer_ids, TINY_TARGET.num_layers, 2).indices
    prompts = torch.randint(3, TINY_TARGET.vocab_size, (16, 4), generator=torch.Generator().manual_seed(3))
    data = collect_draft_data(target, prompts, num_new=12, capture=capture, batch_size=8, bf16_autocast=False)
    counts = torch.bincount(data.argmax.flatten(), minlength=TINY_TARGET.vocab_size)
    draft_to_target = draft_vocabulary(counts, TINY_DRAFT.draft_vocab_size)
    draft = build_draft(TINY_DRAFT.hf_config(target_config), draft_to_target, seed=0)
    settings = DraftTraining(
        epochs=15, batch_size=8, num_steps=3, optimiser=OptimiserSettings(1e-2, warmup_steps=2), bf16_autocast=False
    )
    record = train_draft(draft, data, target_to_draft_map(draft_to_target, TINY_TARGET.vocab_size), 1, settings)
    assert record.steps_done == 30
    assert record.curve[-1].loss < 0.75 * record.curve[0].loss
    assert len(record.step_accuracy) == 3


def test_captured_features_pick_one_heads_columns() -> None:
    features = torch.arange(3.0).repeat_interleave(2)[None, :]  # capture (2, 4, 6), width 2: [0 0 1 1 2 2]
    assert captured_features(features, (2, 4, 6), (4, 6)).tolist() == [[1, 1, 2, 2]]
    assert captured_features(features, (2, 4, 6), (6, 2)).tolist() == [[2, 2, 0, 0]]


# Chained MTP head.


def test_mtp_inputs_follow_the_worked_example() -> None:
    tokens = torch.tensor([[10, 11, 12, 13]])  # x
    argmax = torch.tensor([[20, 21, 22, 23]])  # g
    step_tokens, step_labels = mtp_inputs(tokens, argmax, num_layers=2, pad_id=0)
    assert step_tokens[0].tolist() == [[11, 12, 13, 0]]  # x[p + 1]
    assert step_labels[0].tolist() == [[21, 22, 23, IGNORED_LABEL]]  # g[p + 1]
    assert step_tokens[1].tolist() == [[12, 13, 0, 0]]  # x[p + 2]
    assert step_labels[1].tolist() == [[22, 23, IGNORED_LABEL, IGNORED_LABEL]]  # g[p + 2]


def test_unrolled_mtp_matches_the_mtp_runner_step_by_step(tmp_path: Path) -> None:
    """Two rounds of a 3-layer chain as the server runs them: ingest rows 0..5 and draft 3 steps, then ingest rows
    6..9 and draft 3 steps. Every row every layer computed (ingest and draft passes) must equal the row of the causal
    training forward over the round's tokens: the committed ones, then the runner's own drafts."""
    num_layers = 3
    target_dir = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    mtp_dir = write_tiny_chained_mtp(tmp_path / "mtp", target_dir, TinyChainedMTPSpec(num_layers, seed=3))
    target = load_llama_target(target_dir)
    model = load_mtp(mtp_dir).model
    model.fill_shared("embed_tokens", target.model.embed_tokens.weight.detach())
    model.fill_shared("lm_head", target.lm_head.weight.detach())
    capture = model.config.capture_index
    tokens = torch.randint(3, 320, (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        target_hidden = target_forward(target, tokens[None, :10], (capture,)).captured[capture]  # [1, 10, 64]

    recorded: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # per layer, each call's stream rows
    hooks = [
        layer.register_forward_hook(lambda module, args, output, index=index: recorded[index].append(output.stream))
        for index, layer in enumerate(model.layers)
    ]
    runner = MTPRunner(model, KVCacheSettings(num_blocks=32, block_size=4), chain=True)
    rounds = [(0, 6), (6, 10)]
    proposals = []
    for start, end in rounds:
        rows = TargetRows(start, tokens[start + 1 : end + 1].tolist(), target_hidden[0, start:end])
        proposals.append(runner.propose([ProposeInput("a", rows, num_steps=num_layers)])[0])
    for hook in hooks:
        hook.remove()

    calls = [iter(layer_calls) for layer_calls in recorded]
    for (start, end), proposal in zip(rounds, proposals, strict=True):
        # The round's token sequence: committed x[0..end], then the drafts the later layers consumed.
        sequence = torch.cat([tokens[: end + 1], torch.tensor(proposal[:-1])])
        step_tokens = [sequence[None, layer + 1 : layer + 1 + end] for layer in range(num_layers)]
        with torch.no_grad():
            outputs: list[MTPLayerOutput] = unrolled_mtp_outputs(model, target_hidden[:, :end], step_tokens)
        for layer, output in enumerate(outputs):
            ingested = next(calls[layer])  # positions [old extent, new extent): max(0, n - layer) for n = start, end
            expected = output.stream[0, max(0, start - layer) : end - layer]
            assert (ingested - expected).abs().max().item() <= TOLERANCE
            if layer > 0:  # draft step layer + 1: positions [end - layer, end - 1], on this round's guesses
                drafted = next(calls[layer])
                assert (drafted - output.stream[0, end - layer : end]).abs().max().item() <= TOLERANCE
        drafted_again = [int(model.compute_logits(output.normed[0, end - 1]).argmax()) for output in outputs]
        assert drafted_again == proposal
    assert all(next(layer_calls, None) is None for layer_calls in calls)


def test_saved_mtp_loads_with_load_mtp(saved_target: Path, target_config: dict[str, Any], tmp_path: Path) -> None:
    target = load_llama_target(saved_target)
    config = MTPShape(num_layers=2).hf_config(target_config)
    model = build_mtp(config, target, seed=0)
    save_mtp(model, config, tmp_path)
    names = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    first = TINY_TARGET.num_layers
    assert {f"model.layers.{first}.eh_proj.weight", f"model.layers.{first + 1}.self_attn.q_proj.weight"} < names
    assert not any(name.startswith(("model.embed_tokens.", "lm_head.")) for name in names)  # shared, not stored

    loaded = load_mtp(tmp_path)
    assert loaded.missing_shared == ("embed_tokens", "lm_head")
    assert loaded.model.config.capture_index == TINY_TARGET.num_layers
    saved = dict(model.layers.named_parameters())
    for name, parameter in loaded.model.layers.named_parameters():
        assert torch.equal(parameter, saved[name].detach().to(torch.bfloat16).float()), name


def test_mtp_training_reduces_the_loss_and_keeps_the_shared_tables(
    saved_target: Path, target_config: dict[str, Any]
) -> None:
    target = load_llama_target(saved_target)
    capture = (1, TINY_TARGET.num_layers)  # collected for several heads; the MTP head takes the last column
    prompts = torch.randint(3, TINY_TARGET.vocab_size, (16, 4), generator=torch.Generator().manual_seed(3))
    data = collect_draft_data(target, prompts, num_new=12, capture=capture, batch_size=8, bf16_autocast=False)
    model = build_mtp(MTPShape(num_layers=2).hf_config(target_config), target, seed=0)
    settings = DraftTraining(
        epochs=15, batch_size=8, num_steps=2, optimiser=OptimiserSettings(1e-2, warmup_steps=2), bf16_autocast=False
    )
    hidden = captured_features(data.features, capture, (TINY_TARGET.num_layers,))
    record = train_mtp(model, data, hidden, 1, settings)
    assert record.steps_done == 30
    # The frozen LM head of a random target keeps the logits small, so the loss falls little; the argmax learns.
    assert record.curve[-1].loss < record.curve[0].loss - 0.5
    assert len(record.step_accuracy) == 2 and min(record.step_accuracy) > 0.6
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, target.model.embed_tokens.weight)
