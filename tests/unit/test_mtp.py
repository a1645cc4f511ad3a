"""MTP drafts (tandem.models.mtp, draft_server.mtp_runner) against dense references recomputed from scratch, and
DeepSeek-V3 NextN against transformers' own MTP, `generate(use_mtp=True)` (Step-3.5's: tests/unit/test_step3p5_mtp.py).

The references are written here in plain torch around transformers' own decoder layers (DeepseekV3DecoderLayer with
its up-projected MLA and its own router, LlamaDecoderLayer): a dense implementation independent of ours, run over
the whole sequence each time with a causal mask and no cache. enorm / hnorm / eh_proj / shared_head.norm and the
shared embedding and LM head are applied by hand from the checkpoint tensors.

Requests are played over several rounds: the runner proposes, the test accepts a scripted number of the drafts and
commits a correction token (different from the rejected draft), and the target's real hidden rows of the newly
committed positions (its capture at the draft's `capture_index`) go to the next round.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from draft_server.mtp_runner import MTPRunner
from draft_server.runner import DraftRequestError, DraftRunner, ProposeInput, TargetRows
from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.layers.moe import MixtureOfExperts
from tandem.models.config import ConfigError
from tandem.models.mtp import MTPConfig, MTPLayerOutput, MTPModel, NextNDraft, load_mtp, skips_tensor
from tandem.models.registry import TargetModel, load_target
from tandem.settings import KVCacheSettings
from tandem.weights.loader import iter_tensors
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.deepseek_checkpoints import DEEPSEEK_NEXTN, write_tiny_deepseek
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from tests.helpers.step3p5_mtp_checkpoints import (
    FitSpec,
    fit_mtp_layers,
    reference_post_norm,
    tandem_rounds,
    transformers_rounds,
)

CACHE = KVCacheSettings(num_blocks=96, block_size=4)
LLAMA_NUM_LAYERS = 4
NUM_MTP_LAYERS = 3
# Runner and reference differ by float32 rounding (~1e-6); a top-2 logit gap below this could flip the argmax without
# any bug, so the test data must not have one (the test fails naming the margin if a change of seeds makes one).
MIN_MARGIN = 1e-3

# Per request: prompt length (first token included), then (num_steps, accepted drafts) per round.
Script = tuple[int, Sequence[tuple[int, int]]]
NEXTN_SCRIPTS: dict[str, Script] = {
    "a": (8, [(3, 1), (4, 0), (2, 2), (4, 3), (1, 0), (3, 0)]),
    "b": (4, [(2, 0), (4, 2), (3, 3), (2, 1)]),
}
# Accepting fewer drafts than a layer's index leaves that layer's KV at guessed tokens: the boundary recompute matters.
CHAINED_SCRIPTS: dict[str, Script] = {
    "a": (8, [(3, 1), (3, 0), (2, 2), (3, 3), (1, 0), (3, 1), (3, 0)]),
    "b": (4, [(3, 0), (2, 1), (3, 2), (3, 1), (3, 0)]),
}


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [n, h] -> [n, h]
    return weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps))


def greedy(logits: torch.Tensor) -> int:  # [vocab] -> the argmax, refusing near-ties
    top = logits.topk(2).values
    margin = float(top[0] - top[1])
    assert margin > MIN_MARGIN, f"near-tie in the test data (top-2 logit gap {margin:.2e})"
    return int(logits.argmax())


@dataclass(frozen=True)
class DenseMTPLayer:
    """One MTP layer over a whole sequence from scratch: positions 0..n-1, causal mask, no cache."""

    decoder: nn.Module  # transformers' decoder layer
    rotary: nn.Module  # transformers' rotary embedding of the same model
    tensors: dict[str, torch.Tensor]  # enorm / hnorm / eh_proj / shared_head.norm, by their checkpoint suffix
    embedding: torch.Tensor  # [vocab, hidden] the target's
    lm_head: torch.Tensor  # [vocab, hidden] the target's
    eps: float

    def __call__(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        token_ids: Sequence[int],  # [n]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # stream [n, hidden], normed [n, hidden], logits [n, vocab]
        embedded = rms_norm(self.embedding[list(token_ids)], self.tensors["enorm.weight"], self.eps)
        fused = torch.cat([embedded, rms_norm(hidden, self.tensors["hnorm.weight"], self.eps)], -1)
        fused = fused @ self.tensors["eh_proj.weight"].T
        length = len(token_ids)
        positions = torch.arange(length)[None]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            cos_sin = self.rotary(fused[None], positions)
            stream = self.decoder(fused[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        stream = stream[0]
        normed = rms_norm(stream, self.tensors["shared_head.norm.weight"], self.eps)
        return stream, normed, normed @ self.lm_head.T


def dense_layers(mtp_dir: Path, target_dir: Path, scratch: Path) -> list[DenseMTPLayer]:
    """transformers' model of the target family with L + N layers, of which the last N hold the MTP decoder weights
    (the others are left as transformers initialises them and never used)."""
    hf = json.loads((mtp_dir / "config.json").read_text())
    num_layers, num_mtp_layers = hf["num_hidden_layers"], hf["num_nextn_predict_layers"]
    scratch.mkdir()
    (scratch / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": num_layers + num_mtp_layers}))
    (scratch / "model.safetensors").symlink_to(mtp_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32, attn_implementation="eager").eval()
    checkpoint = load_file(str(mtp_dir / "model.safetensors"))
    target = load_file(str(target_dir / "model.safetensors"))
    layers = []
    for index in range(num_mtp_layers):
        prefix = f"model.layers.{num_layers + index}."
        own = {name[len(prefix) :]: tensor for name, tensor in checkpoint.items() if name.startswith(prefix)}
        layers.append(
            DenseMTPLayer(
                decoder=model.model.layers[num_layers + index],
                rotary=model.model.rotary_emb,
                tensors=own,
                embedding=target["model.embed_tokens.weight"],
                lm_head=target["lm_head.weight"],
                eps=hf["rms_norm_eps"],
            )
        )
    return layers


def nextn_reference(
    layer: DenseMTPLayer, feedback: str, hidden: torch.Tensor, tokens: Sequence[int], steps: int
) -> list[int]:
    """DraftRunner's chain, recomputed densely at every step: rows (target hidden of p, x[p+1]) for p < n, then rows
    (the previous row's feedback, d_{j-1})."""
    rows, token_ids, proposals = list(hidden), list(tokens[1:]), []
    for _ in range(steps):
        stream, normed, logits = layer(torch.stack(rows), token_ids)
        proposals.append(greedy(logits[-1]))
        rows.append((normed if feedback == "post_norm" else stream)[-1])
        token_ids.append(proposals[-1])
    return proposals


# (layer, position) -> (hidden row, token) a layer's KV was built from in an earlier round's draft step.
WrittenInputs = dict[tuple[int, int], tuple[torch.Tensor, int]]


def chained_reference(
    layers: Sequence[DenseMTPLayer],
    hidden: torch.Tensor,  # [n, hidden] target rows of positions 0..n-1
    tokens: Sequence[int],  # x[0..n]
    steps: int,
    *,
    chain: bool = True,
    update: bool = True,
    kept: WrittenInputs | None = None,
) -> list[int]:
    """Draft j = argmax at position n - 1 of layer j - 1, all layers 0..j-1 recomputed over positions 0..n-1 on the
    tokens x[0..n] + d_1..d_{j-1}; layer k at p consumes (h_{k-1}[p], x[p+k+1]).

    Faulty variants, for negative controls: `update=False` hands a layer, at the positions the previous layer ran
    speculatively (p >= n - k + 1), that layer's INPUT instead of its output (the missed update between steps);
    `kept` keeps each layer's KV at positions an earlier round's draft steps built from guessed tokens (no boundary
    recompute): read for positions now committed, written with this round's draft-step inputs.
    """
    count = hidden.shape[0]
    proposals: list[int] = []
    for step in range(1, steps + 1):
        extended = [*tokens, *proposals]
        layer_input = hidden
        for layer_index in range(step):
            token_ids = extended[layer_index + 1 : layer_index + 1 + count]
            committed = max(0, count - layer_index)
            if kept is not None:
                layer_input = layer_input.clone()
                for position in range(committed):
                    if (layer_index, position) in kept:
                        layer_input[position], token_ids[position] = kept[layer_index, position]
                if layer_index == step - 1 and layer_index > 0:  # this step ran the layer speculatively here
                    for position in range(committed, count):
                        kept[layer_index, position] = (layer_input[position], token_ids[position])
            stream, _, logits = layers[layer_index](layer_input, token_ids)
            if not chain:
                next_input = hidden
            elif update:
                next_input = stream
            else:
                next_input = torch.cat([stream[:committed], layer_input[committed:]])
            layer_input = next_input
        proposals.append(greedy(logits[count - 1]))
    return proposals


Reference = Callable[[str, torch.Tensor, Sequence[int], int], list[int]]  # (request, hidden, tokens, steps)


def target_hidden(target: TargetModel, tokens: Sequence[int], capture_index: int) -> torch.Tensor:
    """The target's capture over tokens [len, hidden], computed from scratch."""
    layout = target.config.cache_layout
    cache = PagedKVCache(
        target.config.num_layers, 64, 4, layout.num_kv_heads, layout.key_dim, torch.float32, value_dim=layout.value_dim
    )
    metadata = cache.plan([(SequenceKV(), len(tokens))])
    with torch.no_grad():
        return target(torch.tensor(list(tokens)), metadata, cache, (capture_index,)).captured[capture_index]


def play(
    runner: DraftRunner | MTPRunner,
    target: TargetModel,
    capture_index: int,
    scripts: dict[str, Script],
    references: dict[str, Reference],
) -> dict[str, list[list[int]]]:
    """Plays the scripts on the runner; returns the runner's proposals ("runner") and each reference's, per round and
    request, all computed on the same committed tokens (those the runner's drafts led to)."""
    generator = torch.Generator().manual_seed(0)
    tokens = {
        name: torch.randint(3, 320, (length,), generator=generator).tolist() for name, (length, _) in scripts.items()
    }
    sent = dict.fromkeys(scripts, 0)
    results: dict[str, list[list[int]]] = {"runner": [], **{name: [] for name in references}}
    for round_index in range(max(len(rounds) for _, rounds in scripts.values())):
        playing = [name for name, (_, rounds) in scripts.items() if round_index < len(rounds)]
        hidden = {name: target_hidden(target, tokens[name][:-1], capture_index) for name in playing}
        inputs = []
        for name in playing:
            start, steps = sent[name], scripts[name][1][round_index][0]
            rows = TargetRows(start, tokens[name][start + 1 :], hidden[name][start:])
            inputs.append(ProposeInput(name, rows, steps))
        proposals = runner.propose(inputs)
        for name, proposal in zip(playing, proposals, strict=True):
            steps, accepted = scripts[name][1][round_index]
            results["runner"].append(proposal)
            for reference_name, reference in references.items():
                results[reference_name].append(reference(name, hidden[name], tokens[name], steps))
            correction = int(torch.randint(3, 320, (1,), generator=generator))
            if accepted < steps and correction == proposal[accepted]:
                correction = 3 + (correction - 2) % 317
            sent[name] = len(tokens[name]) - 1
            tokens[name] += [*proposal[:accepted], correction]
    return results


# DeepSeek-V3 NextN on the existing DraftRunner.


@dataclass(frozen=True)
class MTPFixture:
    target: TargetModel
    mtp: MTPModel
    dense: list[DenseMTPLayer]
    mtp_dir: Path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> MTPFixture:
    directory = write_tiny_deepseek(tmp_path_factory.mktemp("deepseek"), DEEPSEEK_NEXTN)
    loaded = load_mtp(directory)
    assert loaded.missing_shared == ()  # the target-level tables are in the checkpoint; the layer copies are zeros
    dense = dense_layers(directory, directory, tmp_path_factory.mktemp("hf") / "deepseek")
    return MTPFixture(load_target(directory), loaded.model, dense, directory)


@pytest.mark.parametrize(("feedback", "other"), [("post_norm", "pre_norm"), ("pre_norm", "post_norm")])
def test_nextn_on_draft_runner_matches_dense_reference(deepseek: MTPFixture, feedback: str, other: str) -> None:
    config = deepseek.mtp.config
    assert config.style == "nextn" and config.capture_index == DEEPSEEK_NEXTN.num_layers + 1  # post-final-norm hidden
    runner = DraftRunner(NextNDraft(deepseek.mtp, feedback), CACHE)
    references: dict[str, Reference] = {
        choice: lambda _, hidden, tokens, steps, choice=choice: nextn_reference(
            deepseek.dense[0], choice, hidden, tokens, steps
        )
        for choice in (feedback, other)
    }
    results = play(runner, deepseek.target, config.capture_index, NEXTN_SCRIPTS, references)
    assert results["runner"] == results[feedback]
    assert results["runner"] != results[other]  # the choice matters on this data
    assert len({token for proposal in results["runner"] for token in proposal}) > 5  # not one token over and over


def test_nextn_matches_transformers_generate_use_mtp(tmp_path: Path) -> None:
    """transformers drafts one token a round with DeepSeek's one NextN layer, from the target's post-norm hidden; so
    must NextNDraft at one step. The layer is fitted to the target's own greedy text (tests.helpers
    .step3p5_mtp_checkpoints), so that some drafts are accepted and some are not."""
    directory = write_tiny_deepseek(tmp_path / "deepseek", DEEPSEEK_NEXTN)
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 320, (6,), generator=generator).tolist() for _ in range(2)]
    model: Any = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=30, eos_token_id=None)[0].tolist()
            for p in prompts
        ]
    spec = FitSpec(DEEPSEEK_NEXTN.num_layers, DEEPSEEK_NEXTN.num_nextn_layers, unit_norm=1.0)
    fit_mtp_layers(directory, spec, plain, reference_post_norm(model, plain))
    model = DeepseekV3ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    # transformers looks for DeepSeek-V3's MTP layer at model.layers.61 only; point it at this model's layer.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{DEEPSEEK_NEXTN.num_layers}\..*"]
    target, mtp = load_target(directory), load_mtp(directory).model
    accepted = []
    for prompt, text in zip(prompts, plain, strict=True):
        expected = transformers_rounds(model, prompt, 30)
        runner = DraftRunner(NextNDraft(mtp, "post_norm"), CACHE)
        rounds = tandem_rounds(runner, target, mtp.config.capture_index, prompt, 30, num_steps=1)
        assert (rounds.drafts, rounds.accepted, rounds.tokens) == (expected.drafts, expected.accepted, expected.tokens)
        assert rounds.tokens == text[len(prompt) :]  # lossless
        accepted += rounds.accepted
    assert 0 in accepted and 1 in accepted


def test_loader_reads_only_mtp_layers_and_shared_tables(deepseek: MTPFixture) -> None:
    config = deepseek.mtp.config
    names = [name for name, _ in iter_tensors(deepseek.mtp_dir) if not skips_tensor(config, name)]
    prefix = f"model.layers.{DEEPSEEK_NEXTN.num_layers}."
    assert {name for name in names if not name.startswith(prefix)} == {"model.embed_tokens.weight", "lm_head.weight"}
    assert f"{prefix}eh_proj.weight" in names and f"{prefix}mlp.gate.e_score_correction_bias" in names
    assert not any(name.startswith((f"{prefix}embed_tokens.", f"{prefix}shared_head.head.")) for name in names)


def test_nextn_layer_copies_of_shared_tables_are_not_required(tmp_path: Path) -> None:
    loaded = load_mtp(write_tiny_deepseek(tmp_path, replace(DEEPSEEK_NEXTN, nextn_layer_copies=False)))
    assert loaded.missing_shared == ()


def test_nextn_layer_is_moe_by_the_index_rule(deepseek: MTPFixture) -> None:
    decoder = deepseek.mtp.layers[0].decoder
    assert isinstance(decoder.mlp, MixtureOfExperts)  # layer index 2 >= first_k_dense_replace 1
    assert decoder.self_attn.layer_index == 0  # its own one-layer cache


# Chained MTP on a Llama target.


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> MTPFixture:
    target_dir = write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(num_layers=LLAMA_NUM_LAYERS))
    spec = TinyChainedMTPSpec(num_mtp_layers=NUM_MTP_LAYERS, include_layer_copies=True, seed=3)
    directory = write_tiny_chained_mtp(tmp_path_factory.mktemp("mtp"), target_dir, spec)
    loaded = load_mtp(directory)
    assert loaded.missing_shared == ("embed_tokens", "lm_head")
    target = load_target(target_dir)
    loaded.model.fill_shared("embed_tokens", target.model.embed_tokens.weight.detach())
    loaded.model.fill_shared("lm_head", target.lm_head.weight.detach())
    dense = dense_layers(directory, target_dir, tmp_path_factory.mktemp("hf") / "llama")
    return MTPFixture(target, loaded.model, dense, directory)


def chained(fixture: MTPFixture, **options: Any) -> Reference:
    return lambda _, hidden, tokens, steps: chained_reference(fixture.dense, hidden, tokens, steps, **options)


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "non-chain"])
def test_chained_mtp_matches_dense_reference(llama: MTPFixture, chain: bool) -> None:
    config = llama.mtp.config
    assert config.style == "chained" and config.capture_index == LLAMA_NUM_LAYERS  # pre-norm final stream
    runner = MTPRunner(llama.mtp, CACHE, chain=chain)
    references = {"expected": chained(llama, chain=chain), "other mode": chained(llama, chain=not chain)}
    results = play(runner, llama.target, config.capture_index, CHAINED_SCRIPTS, references)
    assert results["runner"] == results["expected"]
    assert results["runner"] != results["other mode"]
    assert len({token for proposal in results["runner"] for token in proposal}) > 5
    runner.release(list(CHAINED_SCRIPTS))
    assert runner.cache.num_free_blocks == CACHE.num_blocks and not runner.requests


def test_chained_hidden_must_be_updated_between_steps(llama: MTPFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a runner whose steps hand on each layer's input instead of its output (the known bug) is
    caught by the equality with the reference, and reproduces the stale reference exactly."""
    runner = MTPRunner(llama.mtp, CACHE, chain=True)
    run_layer, draft = runner.model.run_layer, runner._draft
    drafting = [False]

    def run_layer_without_update(index: int, input_ids: Any, hidden: Any, metadata: Any, cache: Any) -> MTPLayerOutput:
        output = run_layer(index, input_ids, hidden, metadata, cache)
        return MTPLayerOutput(stream=hidden, normed=output.normed) if drafting[0] else output

    def draft_without_update(*args: Any) -> list[list[int]]:
        drafting[0] = True
        try:
            return draft(*args)
        finally:
            drafting[0] = False

    monkeypatch.setattr(runner.model, "run_layer", run_layer_without_update)
    monkeypatch.setattr(runner, "_draft", draft_without_update)
    references = {"updated": chained(llama), "stale": chained(llama, update=False)}
    results = play(runner, llama.target, llama.mtp.config.capture_index, CHAINED_SCRIPTS, references)
    assert results["runner"] != results["updated"]
    assert results["runner"] == results["stale"]


def test_boundary_kv_must_be_recomputed(llama: MTPFixture) -> None:
    """Without recomputing each layer's KV at the positions built from guessed tokens, drafts differ."""
    kept: dict[str, WrittenInputs] = {name: {} for name in CHAINED_SCRIPTS}
    references: dict[str, Reference] = {
        "recomputed": chained(llama),
        "kept": lambda name, hidden, tokens, steps: chained_reference(
            llama.dense, hidden, tokens, steps, kept=kept[name]
        ),
    }
    runner = MTPRunner(llama.mtp, CACHE, chain=True)
    results = play(runner, llama.target, llama.mtp.config.capture_index, CHAINED_SCRIPTS, references)
    assert results["runner"] == results["recomputed"] != results["kept"]


def rows(start: int, length: int) -> TargetRows:
    generator = torch.Generator().manual_seed(start * 31 + length)
    tokens = torch.randint(3, 320, (length,), generator=generator).tolist()
    return TargetRows(start, tokens, torch.randn(length, 64, generator=generator))


def test_more_steps_than_layers_is_refused(llama: MTPFixture) -> None:
    runner = MTPRunner(llama.mtp, CACHE, chain=True)
    with pytest.raises(DraftRequestError, match="'a': 4 draft steps asked, but the MTP draft has 3 layers"):
        runner.propose([ProposeInput("a", rows(0, 5), num_steps=4)])
    assert not runner.requests


def test_rows_must_continue_or_restart(llama: MTPFixture) -> None:
    runner = MTPRunner(llama.mtp, CACHE, chain=True)
    first = rows(0, 6)
    (proposal,) = runner.propose([ProposeInput("a", first, num_steps=3)])
    with pytest.raises(DraftRequestError, match="rows start at position 8 but the draft holds positions up to 6"):
        runner.propose([ProposeInput("a", rows(8, 2), num_steps=2)])
    with pytest.raises(DraftRequestError, match="rows start at position 4, but the MTP draft continues at position 6"):
        runner.propose([ProposeInput("a", rows(4, 2), num_steps=2)])
    with pytest.raises(DraftRequestError, match="rows start at position 2 but the draft holds positions up to 0"):
        runner.propose([ProposeInput("b", rows(2, 2), num_steps=2)])
    assert [request.length for request in runner.requests["a"].layers] == [6, 6, 6]  # refusals changed nothing
    assert runner.propose([ProposeInput("a", first, num_steps=3)]) == [proposal]  # a restart at 0 starts afresh


def test_short_kv_pool_refuses_the_batch_before_any_change(llama: MTPFixture) -> None:
    # 6 rows, 3 steps: layers 0, 1, 2 end at 6, 6 and 6 positions, 2 blocks of 4 each, 6 blocks in all.
    runner = MTPRunner(llama.mtp, KVCacheSettings(num_blocks=5, block_size=4), chain=True)
    with pytest.raises(OutOfKVBlocks, match="needs 6 more blocks, 5 free"):
        runner.propose([ProposeInput("a", rows(0, 6), num_steps=3)])
    assert not runner.requests and runner.cache.num_free_blocks == 5
    runner.propose([ProposeInput("a", rows(0, 6), num_steps=2)])  # layer 2 stops at 4 positions: 5 blocks
    assert runner.cache.num_free_blocks == 0


def test_shared_tables_must_be_filled(llama: MTPFixture) -> None:
    loaded = load_mtp(llama.mtp_dir)
    runner = MTPRunner(loaded.model, CACHE, chain=True)
    with pytest.raises(RuntimeError, match=r"shared tables \['embed_tokens', 'lm_head'\] not filled"):
        runner.propose([ProposeInput("a", rows(0, 3), num_steps=1)])


def test_config_refusals(llama: MTPFixture) -> None:
    hf = json.loads((llama.mtp_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"^num_nextn_predict_layers: "):
        MTPConfig.from_hf(hf | {"num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match=r"^architectures: 'Gemma3ForCausalLM' has no MTP draft support"):
        MTPConfig.from_hf(hf | {"architectures": ["Gemma3ForCausalLM"]})
    with pytest.raises(ConfigError, match=r"^num_nextn_predict_layers: 3; a NextN draft reuses exactly one layer"):
        NextNDraft(llama.mtp, "post_norm")
