"""Step-3.5's own MTP layers as the draft (tandem.models.mtp, draft_server.mtp_runner), against transformers.

Checkpoints (tests.helpers.step3p5_mtp_checkpoints): a tiny Step3p7ForConditionalGeneration written by transformers'
save_pretrained with 3 MTP layers (full, sliding, full attention) after its 4 layers, "random" as drawn and "fitted"
(layers that guess what the target says, so that acceptance is neither zero nor total), and the hub's text-only
Step3p5ForCausalLM layout of the same tensors with the legacy padded config.

Two references:
- transformers' own MTP, `generate(use_mtp=True)`: its MtpModel feeds layer 0 the target's post-final-norm hidden and
  chains each layer's post-norm output (the "post_norm" flow). With that flow Tandem's runner must propose the same
  drafts in the same rounds, accept as many, and produce the same tokens.
- a dense recomputation over whole sequences built from transformers' MtpModel modules (its enorm, hnorm, eh_proj,
  Step3p7 decoder layer, norm), for both flows: "pre_norm" (SGLang's step3p5_mtp, the authors' serving code and the
  default: the target's stream before its final norm, each layer's stream handed on) and "post_norm".

Where transformers reads the MTP layers otherwise than the checkpoint means, the test data avoids the difference and
Tandem follows the checkpoint (as SGLang does): transformers builds every MTP layer with num_attention_heads (sliding
MTP layers too) and takes MTP layer k's SwiGLU clamps from target layer k's entries (not the padded entry L + k);
it never reads a layer's own `shared_head.output`, nor block weights stored under `.transformer.`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, Step3p7ForConditionalGeneration
from transformers.modeling_layers import MtpModel

from draft_server.compat import IncompatibleDraft
from draft_server.formats import prepare_draft
from draft_server.mtp_runner import MTPRunner
from draft_server.settings import DraftSettings
from tandem.models.mtp import HiddenFlow, MTPModel, load_mtp
from tandem.models.registry import TargetModel, load_target
from tandem.models.step3p5_config import mtp_layers_config
from tandem.wire import target_pb2
from tests.helpers.step3p5_mtp_checkpoints import (
    HIDDEN,
    NUM_LAYERS,
    NUM_MTP,
    STEP_MTP_CONFIG,
    VOCAB,
    FitSpec,
    add_random_mtp_layers,
    edit_tensors,
    fit_mtp_layers,
    reference_post_norm,
    tandem_rounds,
    transformers_rounds,
    write_step3p5_target,
)
from tests.unit.test_mtp import CACHE, CHAINED_SCRIPTS, Reference, greedy, play

FLOWS: tuple[HiddenFlow, ...] = ("pre_norm", "post_norm")
NEW_TOKENS = 30


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (6,), generator=generator).tolist() for _ in range(count)]


def write_hub_layout(directory: Path, step3p7_dir: Path) -> Path:
    """Step3p5ForCausalLM as the hub ships it: the legacy padded config and the text model's tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(step3p7_dir / "model.safetensors"))
    text = {name: t for name, t in tensors.items() if name.startswith(("model.", "lm_head."))}
    save_file(text, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(STEP_MTP_CONFIG, indent=2))
    return directory


def reference(directory: Path) -> PreTrainedModel:
    return Step3p7ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Checkpoints:
    random: Path  # step3p7 layout, random MTP layers
    fitted: dict[str, Path]  # layout -> fitted MTP layers
    target: TargetModel


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    random_dir = tmp_path_factory.mktemp("step3p7-random")
    write_step3p5_target(random_dir)
    add_random_mtp_layers(random_dir, NUM_LAYERS, NUM_MTP)
    fitted_dir = Path(shutil.copytree(random_dir, tmp_path_factory.mktemp("fitted") / "step3p7"))
    model = reference(random_dir)
    with torch.no_grad():
        texts = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)[0]
            for p in prompts(3)
        ]
    token_lists = [text.tolist() for text in texts]
    fit_mtp_layers(fitted_dir, FitSpec(NUM_LAYERS, NUM_MTP, 0.0), token_lists, reference_post_norm(model, token_lists))
    hub_dir = write_hub_layout(tmp_path_factory.mktemp("step3p5-hub"), fitted_dir)
    return Checkpoints(random_dir, {"step3p7": fitted_dir, "step3p5-hub": hub_dir}, load_target(random_dir))


def runner_for(directory: Path, flow: HiddenFlow | None, chain: bool = True) -> MTPRunner:
    loaded = load_mtp(directory)
    assert loaded.missing_shared == ()  # the target-level tables are in the checkpoint
    return MTPRunner(loaded.model, CACHE, chain=chain, flow=flow)


@pytest.mark.parametrize("layout", ["step3p7", "step3p5-hub"])
def test_rounds_match_transformers_generate_use_mtp(checkpoints: Checkpoints, layout: str) -> None:
    directory = checkpoints.fitted[layout]
    model = reference(checkpoints.fitted["step3p7"])
    target = load_target(directory)
    for prompt in prompts(2):  # texts the layers were fitted on
        expected = transformers_rounds(model, prompt, NEW_TOKENS)
        runner = runner_for(directory, "post_norm")
        capture = runner.model.config.capture_index_for("post_norm")
        assert capture == NUM_LAYERS + 1  # the target's post-final-norm hidden, transformers' hidden_states[-1]
        rounds = tandem_rounds(runner, target, capture, prompt, NEW_TOKENS, NUM_MTP)
        assert rounds.drafts == expected.drafts
        assert rounds.accepted == expected.accepted
        assert rounds.tokens == expected.tokens
        with torch.no_grad():
            plain = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None
            )
        assert rounds.tokens == plain[0, len(prompt) :].tolist()  # lossless
        # Both of transformers' cache paths are taken: rounds accepting fewer than N - 1 drafts (the MTP KV of the
        # last N rows recomputed) and rounds accepting N - 1 or more (kept).
        assert min(rounds.accepted) < NUM_MTP - 1 and max(rounds.accepted) == NUM_MTP


def test_default_flow_is_the_authors_and_stays_lossless(checkpoints: Checkpoints) -> None:
    directory = checkpoints.fitted["step3p7"]
    runner = runner_for(directory, None)
    assert runner.flow == "pre_norm" and runner.model.config.capture_index == NUM_LAYERS  # SGLang's step3p5_mtp
    model = reference(directory)
    prompt = prompts(1)[0]
    expected = transformers_rounds(model, prompt, NEW_TOKENS)
    rounds = tandem_rounds(runner, load_target(directory), NUM_LAYERS, prompt, NEW_TOKENS, NUM_MTP)
    assert rounds.tokens == expected.tokens  # greedy output is the target's whatever the draft
    assert rounds.drafts != expected.drafts  # the flow matters on this data
    assert sum(rounds.accepted) > 0


# (hidden [n, h], tokens [n]) -> (stream [n, h], normed [n, h], logits [n, vocab])
DenseLayer = Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def dense_layers(mtp: MtpModel, heads: dict[int, torch.Tensor] | None = None) -> list[DenseLayer]:
    """Each MTP layer over a whole sequence from scratch with transformers' modules, causal, no cache: its stream
    before shared_head.norm, the norm's output and the logits, from `heads[k]` when given, else the target's head."""

    def layer(index: int) -> DenseLayer:
        def run(hidden: torch.Tensor, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            module = mtp.layers[index]
            positions = torch.arange(len(token_ids))[None]
            module.use_post_norm = False  # the stream itself; the norm is applied below
            try:
                with torch.no_grad():
                    ids = torch.tensor([list(token_ids)])
                    stream = mtp.forward_layer(index, hidden[None], positions, None, input_ids=ids)[0]
            finally:
                module.use_post_norm = True
            with torch.no_grad():
                normed = module.post_norm(stream)
                head = (heads or {}).get(index, mtp.shared_head.weight)
                return stream, normed, normed @ head.T

        return run

    return [layer(index) for index in range(len(mtp.layers))]


def chained_reference(
    layers: Sequence[DenseLayer],
    flow: HiddenFlow,
    hidden: torch.Tensor,  # [n, hidden] the target's rows
    tokens: Sequence[int],
    steps: int,
    chain: bool = True,
) -> list[int]:
    """Draft j = argmax at position n - 1 of layer j - 1, layers 0..j-1 recomputed over positions 0..n-1 on the tokens
    x[0..n] + d_1..d_{j-1}; layer k at p consumes (h_{k-1}[p], x[p+k+1]), h_{k-1} handed on as the flow says (chain),
    or the target's rows again (non-chain)."""
    count, proposals = hidden.shape[0], list[int]()
    for step in range(1, steps + 1):
        extended, layer_input = [*tokens, *proposals], hidden
        for index in range(step):
            stream, normed, logits = layers[index](layer_input, extended[index + 1 : index + 1 + count])
            layer_input = (normed if flow == "post_norm" else stream) if chain else hidden
        proposals.append(greedy(logits[count - 1]))
    return proposals


def mtp_reference(directory: Path) -> MtpModel:
    model = reference(directory)
    return MtpModel.from_pretrained(model, device_map={"": torch.device("cpu")}).eval()


@pytest.mark.parametrize(("flow", "chain"), [("pre_norm", True), ("post_norm", True), ("pre_norm", False)])
def test_chained_layers_match_dense_reference(checkpoints: Checkpoints, flow: HiddenFlow, chain: bool) -> None:
    mtp = mtp_reference(checkpoints.random)
    layers = dense_layers(mtp)
    other: HiddenFlow = "post_norm" if flow == "pre_norm" else "pre_norm"
    runner = runner_for(checkpoints.random, flow, chain)
    capture = runner.model.config.capture_index_for(flow)

    def expected(choice: HiddenFlow, chained: bool) -> Reference:
        return lambda _, hidden, tokens, steps: chained_reference(layers, choice, hidden, tokens, steps, chained)

    # Negative controls, fed the same target rows: the other flow (chain), or the chain (non-chain).
    references = {"flow": expected(flow, chain), "other": expected(other, True) if chain else expected(flow, True)}
    results = play(runner, checkpoints.target, capture, CHAINED_SCRIPTS, references)
    assert results["runner"] == results["flow"] != results["other"]
    assert len({token for proposal in results["runner"] for token in proposal}) > 5


def test_own_head_and_transformer_block_prefix(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """Layer 1 ships its own shared_head.output (used for its drafts), layer 2 keeps its block under .transformer."""
    directory = Path(shutil.copytree(checkpoints.random, tmp_path / "variant"))
    own_head = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(9)) * HIDDEN**-0.5

    def edit(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        block = f"model.layers.{NUM_LAYERS + 2}."
        own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
        moved = {
            (
                block + "transformer." + name[len(block) :]
                if name.startswith(block) and not name[len(block) :].startswith(own)
                else name
            ): t
            for name, t in tensors.items()
        }
        return moved | {f"model.layers.{NUM_LAYERS + 1}.shared_head.output.weight": own_head}

    edit_tensors(directory, edit)
    loaded = load_mtp(directory)
    assert loaded.model.config.own_heads == (False, True, False)
    assert f"model.layers.{NUM_LAYERS + 2}.transformer.self_attn.q_proj.weight" in load_file(
        str(directory / "model.safetensors")
    )
    mtp = mtp_reference(checkpoints.random)  # the same weights in the layout transformers reads
    with_head, without = dense_layers(mtp, {1: own_head}), dense_layers(mtp)
    runner = MTPRunner(loaded.model, CACHE, chain=True)

    def expected(layers: Sequence[DenseLayer]) -> Reference:
        return lambda _, hidden, tokens, steps: chained_reference(layers, "pre_norm", hidden, tokens, steps)

    results = play(
        runner,
        checkpoints.target,
        NUM_LAYERS,
        CHAINED_SCRIPTS,
        {"own": expected(with_head), "shared": expected(without)},
    )
    assert results["runner"] == results["own"] != results["shared"]


def test_mtp_layers_read_alike_from_both_config_layouts(checkpoints: Checkpoints) -> None:
    saved = json.loads((checkpoints.fitted["step3p7"] / "config.json").read_text())
    assert "num_nextn_predict_layers" not in saved and saved["text_config"]["num_nextn_predict_layers"] == NUM_MTP
    legacy, current = mtp_layers_config(STEP_MTP_CONFIG), mtp_layers_config(saved)
    assert legacy.sliding_layers == current.sliding_layers == (False, True, False)
    assert legacy.moe_layers == current.moe_layers == (False, False, False)
    assert legacy.layer_heads == current.layer_heads == (4, 4, 4)
    assert legacy.num_layers == NUM_MTP and legacy.ropes == current.ropes
    padded = STEP_MTP_CONFIG | {"swiglu_limits_shared": [0, 0, 0, 0.3, 5.0, 0, 0], "moe_layers_enum": "1,2,3,5"}
    variant = mtp_layers_config(padded | {"attention_other_setting": {"num_attention_heads": 8}})
    assert variant.swiglu_limits_shared == (5.0, None, None) and variant.moe_layers == (False, True, False)
    assert variant.layer_heads == (4, 8, 4)  # a sliding MTP layer has the sliding layers' heads


def target_info(directory: Path) -> target_pb2.TargetInfo:
    config = load_target(directory).config
    return target_pb2.TargetInfo(
        architecture=config.architecture,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_layers=config.num_layers,
    )


@pytest.mark.parametrize(
    ("feedback", "capture"), [("auto", NUM_LAYERS), ("pre_norm", NUM_LAYERS), ("post_norm", NUM_LAYERS + 1)]
)
def test_prepared_draft_subscribes_to_the_flows_capture(checkpoints: Checkpoints, feedback: Any, capture: int) -> None:
    directory = checkpoints.fitted["step3p7"]
    settings = DraftSettings(directory, "target:1", num_steps=NUM_MTP, mtp_feedback=feedback)
    prepared = prepare_draft(settings, target_info(directory))
    assert (prepared.kind, prepared.capture.indices, prepared.missing_tables) == ("chained-mtp", (capture,), ())
    runner = prepared.build_runner(CACHE)
    assert isinstance(runner, MTPRunner) and runner.flow == ("post_norm" if capture > NUM_LAYERS else "pre_norm")


def test_draft_of_another_width_is_refused(checkpoints: Checkpoints, tmp_path: Path) -> None:
    narrow = STEP_MTP_CONFIG | {"hidden_size": 32}
    write_step3p5_target(tmp_path, narrow)
    add_random_mtp_layers(tmp_path, NUM_LAYERS, NUM_MTP)
    settings = DraftSettings(tmp_path, "target:1", num_steps=NUM_MTP)
    with pytest.raises(IncompatibleDraft, match="hidden_size: the MTP checkpoint has 32, the target has 64"):
        prepare_draft(settings, target_info(checkpoints.fitted["step3p7"]))
    too_many = DraftSettings(checkpoints.fitted["step3p7"], "target:1", num_steps=NUM_MTP + 1)
    with pytest.raises(IncompatibleDraft, match="4 draft steps, but the MTP draft has 3 layers"):
        prepare_draft(too_many, target_info(checkpoints.fitted["step3p7"]))


def test_runner_model_is_step_blocks(checkpoints: Checkpoints) -> None:
    model: MTPModel = load_mtp(checkpoints.random).model
    assert [layer.decoder.self_attn.sliding_window for layer in model.layers] == [None, 8, None]
    assert all(layer.decoder.self_attn.layer_index == 0 and layer.decoder.mlp is not None for layer in model.layers)
    assert model.layers[0].enorm.unit_offset and model.layers[0].shared_head.output is None
