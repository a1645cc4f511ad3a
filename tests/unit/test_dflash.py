"""The block drafters, DFlash, DFlash2 and DSpark (tandem.models.dflash and .dflash2 on draft_server.block_runner),
against a plain-torch reference of the published semantics (tests.helpers.dflash_reference), on tiny Llama, Qwen3 and
Gemma 3 targets made with transformers (a Gemma target's drafter scales the embedding rows and the logits): the same
drafts, round after round, for requests batched together and for a request replayed from scratch, the same logits,
and DSpark's confidences; and the start-up checks that refuse a draft that does not fit its target, naming both
values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from draft_server.block_runner import BlockRunner
from draft_server.compat import IncompatibleDraft
from draft_server.formats import check_dflash
from draft_server.runner import ProposeInput, TargetRows
from orchestrator.peers.grpc_backends import BLOCK_KINDS
from tandem.models.config import ConfigError, read_hf_config
from tandem.models.dflash import SHARED_TABLES, DFlashConfig, default_target_layer_ids, load_dflash
from tandem.models.dflash2 import DFlash2Fields, load_block_draft
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from tests.helpers.checkpoints import TinyTargetSpec, read_target_tensor, write_tiny_target
from tests.helpers.dflash_checkpoints import (
    TinyDFlash2Spec,
    TinyDFlashSpec,
    TinyDSparkSpec,
    write_tiny_dflash,
    write_tiny_dflash2,
    write_tiny_dspark,
)
from tests.helpers.dflash_reference import ReferenceDFlash
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3

PROMPTS = ([5, 17, 42, 99, 7, 3, 250, 18, 61, 77, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 30, 31, 32, 33, 34, 35, 36, 37])
ROUNDS = 8


def target_of(family: str) -> Callable[[Path], Path]:
    if family == "gemma3":
        return lambda directory: write_tiny_gemma3(directory, TinyGemma3Spec())
    return lambda directory: write_tiny_target(directory, TinyTargetSpec(family=family))  # type: ignore[arg-type]


# A Gemma target's drafter: the block's rows are the stored table times sqrt(hidden) (its model scales inside), and
# the logits scaled and capped (a cap of 2 bends logits of a few units).
GEMMA_FIELDS = (("input_embedding_scale", 8.0), ("output_multiplier", 0.5), ("final_logit_softcapping", 2.0))
PAIRS = {
    "llama-dflash": ("llama", lambda d, t: write_tiny_dflash(d, t, TinyDFlashSpec())),
    "qwen3-dflash": ("qwen3", lambda d, t: write_tiny_dflash(d, t, TinyDFlashSpec())),
    "gemma3-dflash": ("gemma3", lambda d, t: write_tiny_dflash(d, t, TinyDFlashSpec(dflash_fields=GEMMA_FIELDS))),
    # DFlash2: a dynamic convolution around every sublayer, drafts chosen among each row's top 4 by the selector.
    "qwen3-dflash2": ("qwen3", lambda d, t: write_tiny_dflash2(d, t, TinyDFlash2Spec())),
    # DSpark: drafts from every row, a Markov head (vanilla, gated), a confidence head, its own copy of the tables.
    "qwen3-dspark": ("qwen3", lambda d, t: write_tiny_dspark(d, t, TinyDSparkSpec())),
    "qwen3-dspark-gated": (
        "qwen3",
        lambda d, t: write_tiny_dspark(
            d, t, TinyDSparkSpec(markov_head_type="gated", confidence_with_markov=False, include_tables=False)
        ),
    ),
}


def written(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    family, write_draft = PAIRS[name]
    target = target_of(family)(tmp_path_factory.mktemp("target"))
    return target, write_draft(tmp_path_factory.mktemp("draft"), target)


@pytest.fixture(scope="module", params=list(PAIRS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return written(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[name for name in PAIRS if "dspark" in name])
def dspark_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return written(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[name for name in PAIRS if "dflash" in name])
def dflash_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return written(request.param, tmp_path_factory)


@dataclass
class Request:
    """One request decoded greedily by the transformers target, with the rows a Tandem target would send."""

    name: str
    tokens: list[int]
    rows: TargetRows
    drafts: list[list[int]] = field(default_factory=list)


def start(target: PreTrainedModel, reference: ReferenceDFlash, name: str, prompt: list[int]) -> Request:
    output = target(torch.tensor([prompt]), output_hidden_states=True)
    tokens = [*prompt, int(output.logits[0, -1].argmax())]
    return Request(name, tokens, TargetRows(0, tokens[1:], reference.features(output.hidden_states)))


def verify(
    target: PreTrainedModel, reference: ReferenceDFlash, request: Request, drafts: list[int], accepted: int
) -> None:
    """Takes the first `accepted` drafts as if the target had accepted them (the tiny random draft seldom drafts
    what the target would, and longer rows are what this test needs), then the target's greedy token; the request's
    next rows are the positions verified."""
    anchor = len(request.tokens) - 1
    output = target(torch.tensor([request.tokens + drafts]), output_hidden_states=True)
    choices = output.logits[0, anchor:].argmax(-1).tolist()
    request.tokens += [*drafts[:accepted], choices[accepted]]
    features = reference.features(output.hidden_states)[anchor : anchor + accepted + 1]
    request.rows = TargetRows(anchor, request.tokens[anchor + 1 :], features)


def reference_of(target_dir: Path, draft: Path) -> tuple[PreTrainedModel, ReferenceDFlash]:
    """transformers' target and the reference drafter over it."""
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    return target, ReferenceDFlash(draft, target)


def runner_for(draft: Path, target_dir: Path) -> BlockRunner:
    model, missing = load_block_draft(draft)
    tables = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}
    tied = read_hf_config(target_dir).get("tie_word_embeddings", False)
    for name in missing:
        model.fill_table(name, read_target_tensor(target_dir, tables["embed_tokens" if tied else name]))
    return BlockRunner(model, KVCacheSettings(block_size=4, num_blocks=64))


@torch.no_grad()
def test_drafts_equal_the_reference_round_after_round(pair: tuple[Path, Path]) -> None:
    target_dir, draft = pair
    target, reference = reference_of(target_dir, draft)
    runner = runner_for(draft, target_dir)
    requests = [start(target, reference, f"r{i}", prompt) for i, prompt in enumerate(PROMPTS)]
    context = {request.name: request.rows.features for request in requests}
    per_block = runner.model.config.drafts_per_block
    assert per_block == (4 if reference.dspark else 3)
    for round_number in range(ROUNDS):
        steps = [per_block, 1 + round_number % 3]  # a whole block, and fewer
        inputs = [ProposeInput(r.name, r.rows, k) for r, k in zip(requests, steps, strict=True)]
        proposals = [list(tree.tokens) for tree in runner.propose(inputs)]
        for request, k, proposal in zip(requests, steps, proposals, strict=True):
            expected, _ = reference.drafts(context[request.name], request.tokens[-1], k)
            assert proposal == expected, f"{request.name}, round {round_number}"
            request.drafts.append(proposal)
            verify(target, reference, request, proposal, accepted=min(k, round_number % 4))
            context[request.name] = torch.cat([context[request.name], request.rows.features])
    # The KV holds the context of every position ingested (up to where the rows not yet drafted from start), and no
    # block rows.
    assert [runner.requests[r.name].kv.length for r in requests] == [r.rows.start_position for r in requests]
    assert requests[0].drafts != requests[1].drafts

    # A replay from scratch (rows from position 0 with every verified position) drafts what the continuing run does.
    replayed = requests[0]
    runner.release([replayed.name])
    rows = TargetRows(0, replayed.tokens[1:], context[replayed.name])
    again = list(runner.propose([ProposeInput(replayed.name, rows, 3)])[0].tokens)
    assert again == reference.drafts(context[replayed.name], replayed.tokens[-1], 3)[0]


@torch.no_grad()
def test_dspark_confidences_equal_the_reference(dspark_pair: tuple[Path, Path]) -> None:
    target_dir, draft = dspark_pair
    target, reference = reference_of(target_dir, draft)
    runner = runner_for(draft, target_dir)
    request = start(target, reference, "r", list(PROMPTS[0]))
    (tree,) = runner.propose([ProposeInput("r", request.rows, 4)])
    drafts = list(tree.tokens)
    expected_drafts, expected = reference.drafts(request.rows.features, request.tokens[-1], 4)
    assert drafts == expected_drafts and len(tree.scores) == 4  # the chain comes scored by the confidence head
    assert torch.allclose(torch.tensor(tree.scores), torch.tensor(expected), atol=1e-5)
    assert tree.fault(4, runner.model.config.vocab_size) == ""
    # Negative control: without the Markov head the same block drafts otherwise, so the equality above checks it.
    reference.weights["markov_head.markov_w2.weight"] = torch.zeros_like(
        reference.weights["markov_head.markov_w2.weight"]
    )
    assert reference.drafts(request.rows.features, request.tokens[-1], 4)[0] != drafts


@torch.no_grad()
def test_a_gemma_drafters_scales_are_applied(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The block's logits equal the reference's with the embedding scale, output multiplier and softcap of a Gemma
    target's drafter; without any one of them the reference's differ (so the equality checks each)."""
    target_dir, draft = written("gemma3-dflash", tmp_path_factory)
    target, reference = reference_of(target_dir, draft)
    runner = runner_for(draft, target_dir)
    request = start(target, reference, "r", list(PROMPTS[1]))
    rows: list[torch.Tensor] = []
    hook = runner.model.register_forward_hook(lambda module, args, hidden: rows.append(hidden))
    runner.propose([ProposeInput("r", request.rows, 3)])
    hook.remove()
    logits = reference.block_logits(request.rows.features, request.tokens[-1])
    assert torch.allclose(runner.model.logits(rows[0]), logits, atol=1e-4)
    assert logits.abs().max() < 2.0  # capped at 2
    for name, plain in (("embedding_scale", 1.0), ("output_multiplier", 1.0), ("softcap", None)):
        changed = ReferenceDFlash(draft, target)
        setattr(changed, name, plain)
        assert not torch.allclose(changed.block_logits(request.rows.features, request.tokens[-1]), logits, atol=1e-3)


def test_the_window_and_the_context_matter(dflash_pair: tuple[Path, Path]) -> None:
    """Negative control: the reference's drafts change when its sliding window or its context is taken away, so
    the equality above checks both."""
    target_dir, draft = dflash_pair
    target, reference = reference_of(target_dir, draft)
    with torch.no_grad():
        request = start(target, reference, "r", list(PROMPTS[1]))
        features = request.rows.features
        logits = reference.block_logits(features, request.tokens[-1])
        reference.windows = [None] * len(reference.windows)
        assert not torch.allclose(reference.block_logits(features, request.tokens[-1]), logits, atol=1e-3)
        assert not torch.allclose(reference.block_logits(features[-2:], request.tokens[-1]), logits, atol=1e-3)


def test_config_reading(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec(num_layers=8))
    spec = TinyDFlashSpec(
        block_size=5,
        block_size_location="dflash_config",
        target_layer_ids=None,
        num_layers=3,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    )
    config = DFlashConfig.from_hf(read_hf_config(write_tiny_dflash(tmp_path / "draft", target, spec)))
    assert (config.block_size, config.mask_token_id, config.windows) == (5, 319, (6, None, 6))
    assert config.target_layer_ids == default_target_layer_ids(8, 3) == (1, 3, 5)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's DFlash drafts
    assert config.capture_indices(8) == (2, 4, 6)
    assert DFlashConfig.from_hf(read_hf_config(write_tiny_dflash(tmp_path / "d2", target))).capture_indices(8) == (
        1,
        3,
        4,
    )
    # The last layer's output is the final norm's (transformers' last hidden state): capture index L + 1.
    assert DFlashConfig.from_hf(read_hf_config(write_tiny_dflash(tmp_path / "d3", target))).capture_indices(4) == (
        1,
        3,
        5,
    )


def info(**fields: object) -> target_pb2.TargetInfo:
    values: dict[str, object] = {"architecture": "LlamaForCausalLM", "hidden_size": 64, "vocab_size": 320}
    return target_pb2.TargetInfo(**(values | {"num_layers": 4} | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "target", "num_steps", "named"),
    [
        (
            TinyDFlashSpec(target_layer_ids=(0, 4)),
            info(),
            3,
            "target_layer_ids: the draft has [0, 4], the target has layers 0..3",
        ),
        (
            TinyDFlashSpec(mask_token_id=400),
            info(),
            3,
            "mask_token_id: the draft has 400, the target has vocab_size 320",
        ),
        (TinyDFlashSpec(hidden_size=32), info(), 3, "hidden_size: the draft has 32, the target has 64"),
        (
            TinyDFlashSpec(vocab_size=300, mask_token_id=5),
            info(),
            3,
            "vocab_size: the draft has 300, the target has 320",
        ),
        (TinyDFlashSpec(num_target_layers=36), info(), 3, "num_target_layers: the draft has 36, the target has 4"),
        (TinyDFlashSpec(), info(), 4, "speculative-num-steps: 4 drafts asked, the draft's block_size 4 gives 3"),
    ],
)
def test_a_draft_that_does_not_fit_is_refused_naming_both(
    tmp_path: Path, spec: TinyDFlashSpec, target: target_pb2.TargetInfo, num_steps: int, named: str
) -> None:
    target_dir = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    config = DFlashConfig.from_hf(read_hf_config(write_tiny_dflash(tmp_path / "draft", target_dir, spec)))
    with pytest.raises(IncompatibleDraft, match="DFlash draft does not fit") as refused:
        check_dflash(config, target, num_steps)
    assert named in str(refused.value)


def test_a_config_without_what_dflash_needs_is_refused(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    hf = read_hf_config(write_tiny_dflash(tmp_path / "draft", target))
    with pytest.raises(ConfigError, match="mask_token_id: missing"):
        DFlashConfig.from_hf(hf | {"dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(ConfigError, match="block_size: 1"):
        DFlashConfig.from_hf(hf | {"block_size": 1})
    check_dflash(DFlashConfig.from_hf(hf), info(), 3)  # the same draft, as written, fits


def test_dflash2s_convolutions_and_selector_matter(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Negative control: the reference's DFlash2 logits change without either convolution's dynamic part or its
    kernel, and its drafts without the selector's transition, so the equality of drafts above checks all three."""
    target_dir, draft = written("qwen3-dflash2", tmp_path_factory)
    target, reference = reference_of(target_dir, draft)
    with torch.no_grad():
        request = start(target, reference, "r", list(PROMPTS[0]))
        features, anchor = request.rows.features, request.tokens[-1]
        logits = reference.block_logits(features, anchor)
        drafts = reference.drafts(features, anchor, 3)[0]
        assert drafts != logits.argmax(-1).tolist()  # the selector chose other than the argmax somewhere
        weights = dict(reference.weights)
        for sublayer in ("attention_conv", "mlp_conv"):
            for leaf in ("kernel_projection.weight", "base_kernel"):
                name = f"layers.1.{sublayer}.{leaf}"
                reference.weights = weights | {name: weights[name] * (0 if "projection" in leaf else 0.5)}
                assert not torch.allclose(reference.block_logits(features, anchor), logits, atol=1e-3), name
        book = "candidate_selector.successor_codebook"
        reference.weights = weights | {book: torch.zeros_like(weights[book])}
        assert reference.drafts(features, anchor, 3)[0] == logits.argmax(-1).tolist()


def dflash2_written(tmp_path: Path, spec: TinyDFlash2Spec) -> dict[str, object]:
    target = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    return read_hf_config(write_tiny_dflash2(tmp_path / "draft", target, spec))


@pytest.mark.parametrize(
    ("spec", "num_steps", "named"),
    [
        (TinyDFlash2Spec(TinyDFlashSpec(hidden_size=32)), 3, "hidden_size: the draft has 32, the target has 64"),
        (
            TinyDFlash2Spec(TinyDFlashSpec(vocab_size=300, mask_token_id=5)),
            3,
            "vocab_size: the draft has 300, the target has 320",
        ),
        (TinyDFlash2Spec(), 4, "speculative-num-steps: 4 drafts asked, the draft's block_size 4 gives 3"),
    ],
)
def test_a_dflash2_draft_that_does_not_fit_is_refused_naming_both(
    tmp_path: Path, spec: TinyDFlash2Spec, num_steps: int, named: str
) -> None:
    config = DFlashConfig.from_hf(dflash2_written(tmp_path, spec))
    with pytest.raises(IncompatibleDraft, match="DFlash2 draft does not fit") as refused:
        check_dflash(config, info(), num_steps)
    assert named in str(refused.value)


def test_a_dflash2_config_is_read_and_checked(tmp_path: Path) -> None:
    hf = dflash2_written(tmp_path, TinyDFlash2Spec(conv_kernel_size=3, selector_top_k=6))
    assert DFlash2Fields.from_hf(hf, 64, 320) == DFlash2Fields(taps=3, group_size=16, rank=8, top_k=6)
    model, missing = load_block_draft(tmp_path / "draft")
    assert (type(model).__name__, model.config.drafts_per_block, missing) == ("DFlash2Draft", 3, SHARED_TABLES)
    assert "dflash2" in BLOCK_KINDS  # the orchestrator reads its Proposes as one forward's, whatever k
    with pytest.raises(ConfigError, match="a DFlash2 draft; load it with"):
        load_dflash(tmp_path / "draft")  # DFlash's loader would leave the convolutions and selector unread
    dflash = hf["dflash_config"]
    assert isinstance(dflash, dict)
    with pytest.raises(ConfigError, match="selector_top_k: None"):
        DFlash2Fields.from_hf(
            hf | {"dflash_config": {k: v for k, v in dflash.items() if k != "selector_top_k"}}, 64, 320
        )
    with pytest.raises(ConfigError, match="conv_group_size: 16 does not divide hidden_size 40"):
        DFlash2Fields.from_hf(hf, 40, 320)
    with pytest.raises(ConfigError, match="selector_top_k: 6 candidates, but vocab_size is 5"):
        DFlash2Fields.from_hf(hf, 64, 5)


@torch.no_grad()
def test_dflash2_chooses_among_the_shaped_candidates(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A request's logit bias shapes each row before its candidates are taken: biased away from the unshaped drafts,
    the drafts are the reference's over the biased logits, none of them an unshaped one."""
    target_dir, draft = written("qwen3-dflash2", tmp_path_factory)
    target, reference = reference_of(target_dir, draft)
    runner = runner_for(draft, target_dir)
    request = start(target, reference, "r", list(PROMPTS[0]))
    plain = set(runner.propose([ProposeInput("r", request.rows, 3)])[0].tokens)
    runner.release(["r"])
    shaping = Shaping(SamplingParams(logit_bias=tuple((t, -100.0) for t in plain)), len(PROMPTS[0]), (*request.tokens,))
    shaped = list(runner.propose([ProposeInput("r", request.rows, 3, shaping)])[0].tokens)
    bias = torch.zeros(runner.model.config.vocab_size)
    bias[list(plain)] = -100.0
    head = reference.head
    reference.head = lambda hidden: head(hidden) + bias  # type: ignore[method-assign]
    assert shaped == reference.drafts(request.rows.features, request.tokens[-1], 3)[0]
    assert not set(shaped) & plain
