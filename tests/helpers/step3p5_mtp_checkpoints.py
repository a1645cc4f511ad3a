"""Tiny Step-3.5 checkpoints with MTP layers, MTP layers fitted to their target, and speculative rounds played by
transformers' `generate(use_mtp=True)` and by a Tandem MTP draft runner, for comparing the two.

Checkpoints: transformers' Step3p7ForConditionalGeneration built from STEP_MTP_CONFIG (a legacy hub config whose
per-layer lists are padded for the 3 MTP layers) and written by its own save_pretrained, plus MTP layers
`model.layers.{4 + k}.*` as the hub stores them: a dense Step-3.5 decoder layer (the tensors of target layer 0,
redrawn) and the MTP layer's own enorm, hnorm, eh_proj and shared_head.norm.

Fitted MTP layers (`fit_mtp_layers`): random MTP layers draft next to nothing the target accepts, so the round counts
would hardly test anything. A fitted layer keeps its random decoder layer, with its output projections scaled down,
and gets an eh_proj solved by least squares so that, on the target's own greedy text, the layer's output is close
to the target's post-norm hidden state one position later: layer k then guesses what the target says k + 1 tokens
on, as a trained layer does. Its norms are plain (identity) scales.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, Step3p7Config, Step3p7ForConditionalGeneration, Step3p7TextConfig
from transformers.generation.candidate_generator import MTPCandidateGenerator

from draft_server.mtp_runner import MTPRunner
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.models.registry import TargetModel
from tests.helpers.checkpoints import redraw_parameters
from tests.helpers.mtp_checkpoints import mtp_own_tensors

SLIDING, FULL = "sliding_attention", "full_attention"
NUM_LAYERS, NUM_MTP, HIDDEN, VOCAB = 4, 3, 64, 320
# Sliding layers have the full layers' query heads here: transformers builds every MTP layer with
# num_attention_heads (its MTP config drops the per-layer head counts). The MTP layers are full, sliding (window 8,
# shorter than the texts), full; dense (moe_layers_enum names target layers only); no clamps on them, and none on
# target layers 0-2 either, whose swiglu_limits_shared entries transformers reads for MTP layers 0-2 (see
# tests/unit/test_step3p5_mtp.py).
STEP_MTP_CONFIG: dict[str, Any] = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_attention_groups": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "share_expert_dim": 48,
    "moe_layers_enum": "1,2,3",
    "moe_router_scaling_factor": 2.5,
    "sliding_window": 8,
    "layer_types": [SLIDING, FULL, SLIDING, FULL, FULL, SLIDING, FULL],
    "attention_other_setting": {"attention_type": SLIDING, "num_attention_heads": 4, "num_attention_groups": 2},
    "rope_theta": [1000.0, 50000.0, 1000.0, 50000.0, 50000.0, 1000.0, 50000.0],
    "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0, 1.0, 0.5, 1.0],
    "swiglu_limits": [0, 7.0, 0, 0.4, 0, 0, 0],
    "swiglu_limits_shared": [0, 0, 0, 0.3, 0, 0, 0],
    "num_nextn_predict_layers": NUM_MTP,
    "use_head_wise_attn_gate": True,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
VISION_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# Output projections of a fitted layer's decoder layer are scaled by this: small enough that the fit still guesses
# well, large enough that attention and its KV change the logits.
BLOCK_SCALE = 0.15
NORM_SPREAD = 0.5


def write_step3p5_target(directory: Path, legacy_config: dict[str, Any] = STEP_MTP_CONFIG, seed: int = 0) -> None:
    """transformers' Step3p7ForConditionalGeneration from legacy_config, redrawn, written by save_pretrained."""
    legacy = {key: value for key, value in legacy_config.items() if key not in ("architectures", "model_type")}
    config = Step3p7Config(text_config=Step3p7TextConfig(**legacy).to_dict(), vision_config=VISION_CONFIG)
    with torch.random.fork_rng(devices=[]):
        model = Step3p7ForConditionalGeneration(config)
    generator = torch.Generator().manual_seed(seed)
    redraw_parameters(model, generator, norm_center=0.0, stds={"mlp.gate.weight": 0.2})
    model.save_pretrained(directory)


def add_random_mtp_layers(directory: Path, num_layers: int, num_mtp: int, seed: int = 1) -> None:
    """MTP layers num_layers + k as the hub stores them: target layer 0's tensors redrawn, plus their own."""
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(directory / "model.safetensors"))
    first = {name[len("model.layers.0.") :]: t for name, t in tensors.items() if name.startswith("model.layers.0.")}
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    for index in range(num_layers, num_layers + num_mtp):
        prefix = f"model.layers.{index}."
        tensors |= {prefix + name: torch.randn(t.shape, generator=generator) * t.std() for name, t in first.items()}
        tensors |= mtp_own_tensors(prefix, hidden, generator)
        # A (1 + w) scale far from uniform, so that handing on the normed output differs from the stream.
        tensors[prefix + "shared_head.norm.weight"] = torch.randn(hidden, generator=generator) * NORM_SPREAD
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(edit(tensors), str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def rms_normalized(rows: torch.Tensor) -> torch.Tensor:  # [n, h] -> [n, h]
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-5)


@dataclass(frozen=True)
class FitSpec:
    num_layers: int  # target layers: the MTP layers are num_layers + k
    num_mtp: int
    unit_norm: float  # the stored weight of a scale-1 norm: 0.0 for (1 + w) norms (Step-3.5), 1.0 for DeepSeek's


def fit_mtp_layers(directory: Path, spec: FitSpec, texts: Sequence[Sequence[int]], post_norm: torch.Tensor) -> None:
    """Fits every MTP layer's eh_proj on the target's texts: rows (token x[p+1], post-norm hidden at p) -> the
    post-norm hidden at p + 1. `post_norm` holds each text's target hidden rows, concatenated ([rows, hidden])."""
    tensors = load_file(str(directory / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    inputs, outputs, offset = [], [], 0
    for text in texts:
        rows = post_norm[offset : offset + len(text)]
        offset += len(text)
        tokens = torch.tensor(list(text[1:]))
        inputs.append(torch.cat([rms_normalized(embedding[tokens]), rms_normalized(rows[:-1])], dim=-1))
        outputs.append(rows[1:])
    solution = torch.linalg.lstsq(torch.cat(inputs).double(), torch.cat(outputs).double()).solution
    for index in range(spec.num_layers, spec.num_layers + spec.num_mtp):
        prefix = f"model.layers.{index}."
        tensors[prefix + "eh_proj.weight"] = solution.T.float().contiguous()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[prefix + norm + ".weight"] = torch.full((embedding.shape[1],), spec.unit_norm)
        for name in [name for name in tensors if name.startswith(prefix)]:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name] = tensors[name] * BLOCK_SCALE
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def reference_post_norm(model: PreTrainedModel, texts: Sequence[Sequence[int]]) -> torch.Tensor:
    """The target's post-final-norm hidden rows of each text (transformers' hidden_states[-1]), concatenated."""
    with torch.no_grad():
        rows = [model(torch.tensor([list(text)]), output_hidden_states=True).hidden_states[-1][0] for text in texts]
    return torch.cat(rows)


@dataclass(frozen=True)
class Rounds:
    """A generation: the new tokens and, per verification round, the drafts proposed and how many were accepted."""

    tokens: list[int]
    drafts: list[list[int]]
    accepted: list[int]


def accepted_counts(drafts: Sequence[Sequence[int]], tokens: Sequence[int]) -> list[int]:
    """Per round, the drafts that match the generated tokens: round i starts where round i - 1 left off, after
    its accepted drafts and its correction (or bonus) token; the first token comes from the prefill."""
    counts, position = [], 1
    for proposal in drafts:
        count = 0
        while count < len(proposal) and position + count < len(tokens) and proposal[count] == tokens[position + count]:
            count += 1
        counts.append(count)
        position += count + 1
    return counts


def recorded_rounds(
    generator: type, model: PreTrainedModel, prompt: Sequence[int], new_tokens: int, **options: Any
) -> Rounds:
    """transformers' greedy `generate` with `options` that pick the candidate generator `generator`, each round's
    candidate tokens recorded."""
    drafts: list[list[int]] = []
    original = generator.get_candidates

    def recording(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:  # None: the first call, which lets the prefill run
            drafts.append(candidates[0, input_ids.shape[1] :].tolist())
        return candidates, logits

    generate: Any = model.generate  # not typed
    with mock.patch.object(generator, "get_candidates", recording), torch.no_grad():
        output = generate(
            torch.tensor([list(prompt)]), do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, **options
        )
    tokens = output[0, len(prompt) :].tolist()
    return Rounds(tokens, drafts, accepted_counts(drafts, tokens))


def transformers_rounds(model: PreTrainedModel, prompt: Sequence[int], new_tokens: int, **options: Any) -> Rounds:
    """transformers' greedy `generate(use_mtp=True)`, with each round's candidate tokens recorded."""
    return recorded_rounds(MTPCandidateGenerator, model, prompt, new_tokens, use_mtp=True, **options)


def target_pass(target: TargetModel, tokens: Sequence[int], capture_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over tokens from scratch: logits [n, vocab] and the capture at capture_index [n, hidden]."""
    layout = target.config.cache_layout
    cache = PagedKVCache(
        target.config.num_layers, 64, 4, layout.num_kv_heads, layout.key_dim, torch.float32, value_dim=layout.value_dim
    )
    metadata = cache.plan([(SequenceKV(), len(tokens))])
    with torch.no_grad():
        output = target(torch.tensor(list(tokens)), metadata, cache, (capture_index,))
        return target.compute_logits(output.normed), output.captured[capture_index]


def tandem_rounds(
    runner: MTPRunner | DraftRunner,
    target: TargetModel,
    capture_index: int,
    prompt: Sequence[int],
    new_tokens: int,
    num_steps: int,
) -> Rounds:
    """Greedy speculative decoding with the runner's drafts, verified by the target (recomputed from scratch each
    round): the prefill's token, then rounds of num_steps drafts, the longest prefix equal to the target's argmaxes
    and the target's next token, cut at new_tokens."""
    logits, _ = target_pass(target, prompt, capture_index)
    tokens = [*prompt, int(logits[-1].argmax())]
    drafts: list[list[int]] = []
    sent = 0
    while len(tokens) - len(prompt) < new_tokens:
        _, hidden = target_pass(target, tokens[:-1], capture_index)
        rows = TargetRows(sent, tokens[sent + 1 :], hidden[sent:])
        (proposal,) = runner.propose([ProposeInput("request", rows, num_steps)])
        drafts.append(list(proposal))
        sent = len(tokens) - 1
        verified, _ = target_pass(target, tokens + list(proposal), capture_index)
        choices = verified[len(tokens) - 1 :].argmax(dim=-1).tolist()
        count = 0
        while count < len(proposal) and proposal[count] == choices[count]:
            count += 1
        budget = new_tokens - (len(tokens) - len(prompt))
        tokens += [*proposal[:count], choices[count]][:budget]
    generated = tokens[len(prompt) :]
    return Rounds(generated, drafts, accepted_counts(drafts, generated))
