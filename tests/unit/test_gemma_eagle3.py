"""EAGLE3 heads on Gemma 3 and Gemma 4 targets, with the serving runners in one process, prepared as the draft service
prepares them (draft_server.formats.prepare_draft against the target's info, the embedding filled from the target's
vocab-parallel shards).

Targets are the tiny random checkpoints of tests.helpers.gemma3_checkpoints / gemma4_checkpoints (transformers' own
classes and save_pretrained). Heads are full-vocabulary (no d2t or t2d in the checkpoint) with one aux norm per chunk
(fc_norm), and their output-of-layer ids include the target's last layer, so one capture index is num_layers, the
stream after the last layer before the final norm.

The reference for captured rows is transformers' output_hidden_states: entry i < L is the stream entering layer i;
its last entry L is the final norm's output (tandem capture index L + 1); the stream before the final norm (index L)
comes from a hook on the last layer.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draft_server.formats import prepare_draft
from draft_server.proposals import PreparedDraft
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from draft_server.settings import DraftSettings
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from tandem.parallel.vocab import assemble_shards
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings, TreeShape
from target_server.main import start_target, target_info
from target_server.runner import TargetRunner
from target_server.settings import TargetSettings
from tests.helpers.checkpoints import TinyEagle3Spec, write_tiny_eagle3
from tests.helpers.gemma3_checkpoints import SPECS as GEMMA3_SPECS
from tests.helpers.gemma3_checkpoints import write_tiny_gemma3
from tests.helpers.gemma4_checkpoints import SPECS as GEMMA4_SPECS
from tests.helpers.gemma4_checkpoints import write_tiny_gemma4
from tests.helpers.parity import TOLERANCE, token_ids

GREEDY = SamplingParams()
CACHE = KVCacheSettings(num_blocks=96, block_size=4)
NUM_STEPS = 3
NEW_TOKENS = 16
# Output-of-layer ids (first id 1, so +1): the last id names the last layer, whose output is capture index L.
LAYER_IDS = {"gemma3": (1, 2, 3), "gemma4-dense": (1, 3, 5), "gemma4-moe": (1, 3, 5)}
TARGETS = sorted(LAYER_IDS)


def write_target(name: str, directory: Path) -> Path:
    family, _, variant = name.partition("-")
    if family == "gemma3":
        return write_tiny_gemma3(directory, GEMMA3_SPECS["tied"])
    return write_tiny_gemma4(directory, GEMMA4_SPECS[variant])


def head_spec(name: str, **changes: Any) -> TinyEagle3Spec:
    """A full-vocabulary head without d2t/t2d, with fc_norm, on plain rope (Gemma 4's proportional rope is not a
    Llama head's)."""
    fields: dict[str, Any] = {
        "layer_ids": LAYER_IDS[name],
        "fc_norm": True,
        "write_vocab_map": False,
        "rope_theta": 10_000.0,
        "seed": 3,
    }
    return TinyEagle3Spec(**(fields | changes))


@dataclass(frozen=True)
class Pair:
    name: str
    target_dir: Path
    head_dir: Path
    reference: Any  # transformers' model of the target


@pytest.fixture(scope="module", params=TARGETS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    target_dir = write_target(request.param, tmp_path_factory.mktemp(request.param))
    head_dir = write_tiny_eagle3(tmp_path_factory.mktemp("head"), target_dir, head_spec(request.param))
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return Pair(request.param, target_dir, head_dir, reference)


def reference_streams(model: Any, tokens: Sequence[int]) -> list[torch.Tensor]:
    """transformers' rows by tandem capture index 0..L+1, each [len(tokens), hidden] (module docstring)."""
    decoder: Any = model.get_decoder()
    last_layer: list[torch.Tensor] = []
    handle = decoder.layers[-1].register_forward_hook(
        lambda module, inputs, output: last_layer.append(output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            states = model(torch.tensor([list(tokens)]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    num_layers = len(decoder.layers)
    return [states[index][0] for index in range(num_layers)] + [last_layer[0][0], states[num_layers][0]]


def assert_rows_match(rows: TargetRows, capture: Sequence[int], streams: list[torch.Tensor]) -> None:
    """Each row's features are the capture indices' streams at its position, concatenated in the capture's order."""
    positions = slice(rows.start_position, rows.start_position + len(rows.next_tokens))
    for part, index in zip(rows.features.chunk(len(capture), dim=-1), capture, strict=True):
        difference = (part - streams[index][positions]).abs().max().item()
        assert difference <= TOLERANCE, f"capture index {index}: {difference}"


def as_rows(result: Any) -> TargetRows:
    captured = result.captured
    assert captured is not None
    return TargetRows(captured.start_position, captured.next_tokens, captured.features)


def joined(parts: Sequence[TargetRows]) -> TargetRows:
    for before, after in itertools.pairwise(parts):
        assert after.start_position == before.start_position + len(before.next_tokens)
    tokens = [token for part in parts for token in part.next_tokens]
    return TargetRows(parts[0].start_position, tokens, torch.cat([part.features for part in parts]))


def test_runner_rows_equal_transformers_at_every_capture_index(pair: Pair) -> None:
    runner = start_target(TargetSettings(model_dir=pair.target_dir, cache=CACHE))
    num_layers = runner.model.config.num_layers
    capture = (num_layers, 0, num_layers + 1, *range(1, num_layers))  # every index, not in order
    prompt = token_ids(11, seed=5)
    first = runner.prefill("a", prompt, GREEDY, capture)
    first_rows = as_rows(first)
    parts = [first_rows]
    tokens = list(first.new_tokens)
    for drafts in ([], [7, 8], [9]):  # plain decoding, then drafts that are mostly rejected
        result = runner.verify("a", drafts)
        parts.append(as_rows(result))
        tokens += result.new_tokens
    rows = joined(parts)
    assert rows.start_position == 0 and rows.next_tokens == [*prompt[1:], *tokens]
    streams = reference_streams(pair.reference, [prompt[0], *rows.next_tokens[:-1]])
    assert_rows_match(rows, capture, streams)
    # The prefill's rows are copies: the steps since have not changed them.
    assert_rows_match(first_rows, capture, streams)


def prepared_pair(target_dir: Path, head_dir: Path) -> tuple[TargetRunner, PreparedDraft]:
    """The target runner and the head prepared against it, its embedding filled from the target's shards."""
    runner = start_target(TargetSettings(model_dir=target_dir, cache=CACHE))
    settings = DraftSettings(model_dir=head_dir, target_address="unused", num_steps=NUM_STEPS)
    prepared = prepare_draft(settings, target_info(runner, "float32"))
    assert prepared.missing_tables == ("embed_tokens",)
    vocab_size = runner.model.config.vocab_size
    prepared.fill_table("embed_tokens", assemble_shards(runner.weight_shards("embed_tokens"), vocab_size))
    return runner, prepared


def test_capture_indices_resolve_to_the_final_stream(pair: Pair) -> None:
    runner, prepared = prepared_pair(pair.target_dir, pair.head_dir)
    num_layers = runner.model.config.num_layers
    assert prepared.capture.convention == "output"
    assert prepared.capture.indices == tuple(layer_id + 1 for layer_id in LAYER_IDS[pair.name])
    assert prepared.capture.indices[-1] == num_layers


def test_head_gets_the_target_raw_table(pair: Pair) -> None:
    _, prepared = prepared_pair(pair.target_dir, pair.head_dir)
    runner = prepared.build_proposer(CACHE, TreeShape())
    assert isinstance(runner, DraftRunner)
    draft = runner.model
    assert isinstance(draft, Eagle3Draft)
    raw = load_file(str(pair.target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(draft.embed_tokens.weight, raw)
    assert draft.config.embedding_scale is None  # the heads SpecForge trains look rows up unscaled
    # Full vocabulary without d2t: draft id i is target id i.
    every_id = torch.arange(draft.config.vocab_size)
    assert draft.config.draft_vocab_size == draft.config.vocab_size
    assert torch.equal(draft.to_target_ids(every_id), every_id)


def speculative_greedy(
    runner: TargetRunner, prepared: PreparedDraft, prompt: list[int]
) -> tuple[list[int], int, TargetRows]:
    """Rounds of draft, verify, commit; returns (tokens, drafts accepted, every row the draft was given)."""
    drafter = prepared.build_proposer(CACHE, TreeShape())
    result = runner.prefill("s", prompt, GREEDY, prepared.capture.indices)
    tokens, accepted, given = list(result.new_tokens), 0, [as_rows(result)]
    while len(tokens) < NEW_TOKENS:
        (proposal,) = drafter.propose([ProposeInput("s", given[-1], NUM_STEPS)])
        assert len(proposal) == NUM_STEPS
        result = runner.verify("s", proposal)
        tokens += result.new_tokens
        accepted += result.accepted
        given.append(as_rows(result))
    return tokens[:NEW_TOKENS], accepted, joined(given)


def target_only_greedy(runner: TargetRunner, prompt: list[int]) -> list[int]:
    tokens = list(runner.prefill("plain", prompt, GREEDY).new_tokens)
    while len(tokens) < NEW_TOKENS:
        tokens += runner.verify("plain").new_tokens
    return tokens


def transformers_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            eos_token_id=None,
        )
    return [int(token) for token in output[0, len(prompt) :]]


def test_speculative_greedy_equals_target_only(pair: Pair) -> None:
    runner, prepared = prepared_pair(pair.target_dir, pair.head_dir)
    prompt = token_ids(9, seed=11)
    speculative, _, given = speculative_greedy(runner, prepared, prompt)
    assert speculative == target_only_greedy(runner, prompt) == transformers_greedy(pair.reference, prompt)
    # What the head consumed: transformers' streams at the resolved indices, the final stream among them.
    assert given.next_tokens[: len(prompt) - 1] == prompt[1:]
    streams = reference_streams(pair.reference, [prompt[0], *given.next_tokens[:-1]])
    assert_rows_match(given, prepared.capture.indices, streams)


def with_zero_final_norm(source: Path, destination: Path, weight: float) -> Path:
    """The target with model.norm.weight = weight making the final norm zero (Gemma 4's norm is x * w, Gemma 3's
    x * (1 + w)): every logit 0, so the greedy token is always id 0."""
    shutil.copytree(source, destination)
    tensors = load_file(str(destination / "model.safetensors"))
    tensors["model.norm.weight"].fill_(weight)
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def test_a_head_that_agrees_is_accepted_every_round(pair: Pair, tmp_path: Path) -> None:
    zeroing_weight = -1.0 if pair.name == "gemma3" else 0.0
    target_dir = with_zero_final_norm(pair.target_dir, tmp_path / "target", zeroing_weight)
    head_dir = write_tiny_eagle3(tmp_path / "head", target_dir, head_spec(pair.name, zero_final_norm=True))
    runner, prepared = prepared_pair(target_dir, head_dir)
    tokens, accepted, _ = speculative_greedy(runner, prepared, token_ids(9, seed=12))
    # The head's argmax is draft id 0, target id 0 without d2t: the prefill's token, then k drafts + a bonus a round,
    # so the 16 tokens take 4 rounds (1 + 4 * 4 = 17 committed).
    assert tokens == [0] * NEW_TOKENS
    assert accepted == 4 * NUM_STEPS


def draft_step(model: Eagle3Draft, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Logits of one fresh-cache draft forward over the rows."""
    layer: Any = model.config.layer
    cache = PagedKVCache(1, 8, 4, layer.num_kv_heads, layer.head_dim, torch.float32)
    metadata = cache.plan([(SequenceKV(), len(input_ids))])
    with torch.no_grad():
        return model(input_ids, model.project_features(features), metadata, cache).logits


def test_scale_embeddings_multiplies_the_rows_before_input_layernorm(tmp_path: Path) -> None:
    target_dir = write_tiny_gemma4(tmp_path / "target", GEMMA4_SPECS["dense"])
    raw = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    # A large eps: under it, rows of norm ~0.1 and rows 8 times larger normalise differently.
    heads = {
        scaled: load_eagle3(
            write_tiny_eagle3(
                tmp_path / str(scaled),
                target_dir,
                head_spec("gemma4-dense", rms_norm_eps=0.05, scale_embeddings=scaled),
            )
        )[0]
        for scaled in (False, True)
    }
    assert heads[True].config.embedding_scale == pytest.approx(8.0) and heads[False].config.embedding_scale is None
    heads[False].embed_tokens.weight.data.copy_(raw * 8.0)
    heads[True].embed_tokens.weight.data.copy_(raw)
    input_ids = torch.tensor(token_ids(6, seed=13))
    features = torch.randn((6, 3 * 64), generator=torch.Generator().manual_seed(14))
    scaled, prescaled = draft_step(heads[True], input_ids, features), draft_step(heads[False], input_ids, features)
    assert (scaled - prescaled).abs().max().item() <= 1e-5
    heads[False].embed_tokens.weight.data.copy_(raw)
    assert (scaled - draft_step(heads[False], input_ids, features)).abs().max().item() > 1e-2


def test_config_reads_scale_embeddings(tmp_path: Path) -> None:
    target_dir = write_tiny_gemma4(tmp_path / "target", GEMMA4_SPECS["dense"])
    head_dir = write_tiny_eagle3(tmp_path / "head", target_dir, head_spec("gemma4-dense", scale_embeddings=True))
    hf = json.loads((head_dir / "config.json").read_text())
    assert Eagle3Config.from_hf(hf).embedding_scale == pytest.approx(64**0.5)
    assert Eagle3Config.from_hf({**hf, "scale_embeddings": False}).embedding_scale is None
