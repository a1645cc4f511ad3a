"""Eagle3Draft against an independent reference written here from REFERENCE.md ("EAGLE3 draft checkpoints").

The reference reads the safetensors tensors and config.json directly and recomputes every row from scratch with plain
torch (no cache, no module of ours), so it checks the concat order (embedding first), the place of fc and its norms,
the hidden carried to the next step (pre-norm unless norm_output) and the d2t mapping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from tests.helpers.checkpoints import (
    TinyEagle3Spec,
    TinyTargetSpec,
    target_ids_of_draft,
    write_tiny_eagle3,
    write_tiny_target,
)
from tests.helpers.draft_reference import run_ours, run_reference

TOLERANCE = 1e-4
NUM_INGESTED = 6  # rows of target features ingested at once; with 4 steps after it the draft spans 3 blocks
NUM_STEPS = 4
# A theta other than the usual 10000, so that a draft that ignored the config's theta would be caught.
ROPE_THETA = 500.0
TARGET_HIDDEN = 64  # TinyTargetSpec's hidden size

VARIANTS = {
    "midlayer": TinyEagle3Spec(),
    "layers.0": TinyEagle3Spec(weight_prefix="layers.0"),
    "fc_norm": TinyEagle3Spec(fc_norm=True),
    "legacy_aux_norm": TinyEagle3Spec(fc_norm=True, legacy_aux_norm_names=True),
    "norm_before_fc": TinyEagle3Spec(norm_before_fc=True),
    "norm_output": TinyEagle3Spec(norm_output=True),
    "own_hidden_size": TinyEagle3Spec(hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=8),
    "reduced_vocab": TinyEagle3Spec(draft_vocab_size=48),
    "include_embedding": TinyEagle3Spec(include_embedding=True),
    "two_aux_states": TinyEagle3Spec(layer_ids=[1, 3], fc_norm=True),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec(rope_theta=ROPE_THETA))


# The reference: plain functions of the checkpoint's tensors.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., size] -> [..., size]
    return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:  # [rows, heads, head_dim], row i at position i
    head_dim = x.shape[-1]
    inverse_frequency = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inverse_frequency[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :].float()  # [rows, 1, head_dim]
    first, second = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


@dataclass(frozen=True)
class ReferenceDraft:
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    embedding: torch.Tensor  # [target_vocab, hidden]
    prefix: str  # "midlayer" or "layers.0"

    def weight(self, name: str) -> torch.Tensor:
        return self.tensors[f"{self.prefix}.{name}"]

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [rows, num_aux * target_hidden] -> [rows, hidden]
        eps = self.config["rms_norm_eps"]
        target_hidden = self.config.get("target_hidden_size", self.config["hidden_size"])
        chunks = list(features.split(target_hidden, dim=-1))
        if self.config.get("use_aux_norm"):
            names = ["aux_norm_low.weight", "aux_norm_mid.weight", "aux_norm_high.weight"]
            chunks = [rms_norm(chunk, self.tensors[name], eps) for chunk, name in zip(chunks, names, strict=True)]
        if self.config.get("fc_norm"):
            chunks = [rms_norm(chunk, self.tensors[f"fc_norm.{i}.weight"], eps) for i, chunk in enumerate(chunks)]
        features = torch.cat(chunks, dim=-1)
        if self.config["eagle_config"]["norm_before_fc"]:
            features = rms_norm(features, self.tensors["norm_before_fc.weight"], eps)
        return features @ self.tensors["fc.weight"].T

    def rows(
        self,
        token_ids: list[int],  # target ids; row p takes token_ids[p]
        residuals: torch.Tensor,  # [rows, hidden]; row p sits at position p
    ) -> tuple[torch.Tensor, torch.Tensor]:  # carried hidden [rows, hidden], logits [rows, draft_vocab]
        config = self.config
        eps, heads, kv_heads, head_dim = (
            config["rms_norm_eps"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
        )
        num_rows = residuals.shape[0]
        embedded = rms_norm(self.embedding[token_ids], self.weight("input_layernorm.weight"), eps)
        attention_input = torch.cat([embedded, rms_norm(residuals, self.weight("hidden_norm.weight"), eps)], dim=-1)
        query = (attention_input @ self.weight("self_attn.q_proj.weight").T).view(num_rows, heads, head_dim)
        key = (attention_input @ self.weight("self_attn.k_proj.weight").T).view(num_rows, kv_heads, head_dim)
        value = (attention_input @ self.weight("self_attn.v_proj.weight").T).view(num_rows, kv_heads, head_dim)
        query, key = rotate(query, config["rope_theta"]), rotate(key, config["rope_theta"])
        # Grouped KV heads: query head h reads KV head h // (heads // kv_heads).
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, key) / head_dim**0.5
        causal = torch.ones(num_rows, num_rows, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        attended = torch.einsum("hqk,khd->qhd", weights, value).reshape(num_rows, heads * head_dim)
        stream = residuals + attended @ self.weight("self_attn.o_proj.weight").T
        normed = rms_norm(stream, self.weight("post_attention_layernorm.weight"), eps)
        gate = normed @ self.weight("mlp.gate_proj.weight").T
        up = normed @ self.weight("mlp.up_proj.weight").T
        stream = stream + (F.silu(gate) * up) @ self.weight("mlp.down_proj.weight").T
        final = rms_norm(stream, self.tensors["norm.weight"], eps)
        logits = final @ self.tensors["lm_head.weight"].T
        return (final if config.get("norm_output") else stream), logits

    def to_target_id(self, draft_id: int) -> int:
        return draft_id + int(self.tensors["d2t"][draft_id])


def load_pair(draft_dir: Path, target_dir: Path, spec: TinyEagle3Spec) -> tuple[Eagle3Draft, ReferenceDraft]:
    model, has_embedding = load_eagle3(draft_dir)
    tensors = load_file(str(draft_dir / "model.safetensors"))
    config = json.loads((draft_dir / "config.json").read_text())
    assert has_embedding == spec.include_embedding
    if has_embedding:
        embedding = tensors["embed_tokens.weight"]
        assert torch.equal(model.embed_tokens.weight, embedding)
    else:
        # The draft server copies the target's table here; a draft of another width gets a random table of its own.
        hidden = model.config.hidden_size
        if hidden == json.loads((target_dir / "config.json").read_text())["hidden_size"]:
            embedding = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
        else:
            embedding = torch.randn(model.config.layer.vocab_size, hidden, generator=torch.Generator().manual_seed(9))
        model.embed_tokens.weight.data.copy_(embedding)
    return model, ReferenceDraft(tensors, config, embedding, spec.weight_prefix)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_draft_matches_reference(variant: str, target_dir: Path, tmp_path: Path) -> None:
    spec = VARIANTS[variant]
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, spec)
    model, reference = load_pair(draft_dir, target_dir, spec)

    generator = torch.Generator().manual_seed(1)
    features = torch.randn(NUM_INGESTED, model.config.num_aux * TARGET_HIDDEN, generator=generator)
    token_ids = torch.randint(3, 320, (NUM_INGESTED,), generator=generator).tolist()
    ours = run_ours(model, features, token_ids, NUM_STEPS)
    expected = run_reference(reference, features, token_ids, NUM_STEPS)

    assert ours.logits.dtype == torch.float32
    assert ours.logits.shape == (NUM_INGESTED + NUM_STEPS - 1, model.config.draft_vocab_size)
    assert (ours.logits - expected.logits).abs().max().item() <= TOLERANCE
    assert (ours.hidden - expected.hidden).abs().max().item() <= TOLERANCE
    assert ours.proposed == expected.proposed
    assert set(ours.proposed) <= set(target_ids_of_draft(draft_dir))


def test_reference_sees_each_variant_flag(target_dir: Path, tmp_path: Path) -> None:
    # Guards the reference itself: every variant changes the logits, so a flag the model ignored would show.
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(NUM_INGESTED, 3 * TARGET_HIDDEN, generator=generator)
    token_ids = torch.randint(3, 320, (NUM_INGESTED,), generator=generator).tolist()
    plain_dir = write_tiny_eagle3(tmp_path / "plain", target_dir, TinyEagle3Spec())
    _, plain = load_pair(plain_dir, target_dir, TinyEagle3Spec())
    plain_run = run_reference(plain, features, token_ids, 2)
    for name in ("fc_norm", "norm_before_fc", "norm_output"):
        spec = VARIANTS[name]
        _, reference = load_pair(write_tiny_eagle3(tmp_path / name, target_dir, spec), target_dir, spec)
        run = run_reference(reference, features, token_ids, 2)
        assert not torch.allclose(run.logits, plain_run.logits, atol=1e-3), name


def test_embedding_goes_first_in_the_attention_input(target_dir: Path, tmp_path: Path) -> None:
    # Swapping the two halves of q/k/v's input columns must change the output; our model must not be symmetric.
    spec = TinyEagle3Spec()
    model, reference = load_pair(write_tiny_eagle3(tmp_path, target_dir, spec), target_dir, spec)
    prefix = spec.weight_prefix
    swapped = dict(reference.tensors)
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = swapped[f"{prefix}.self_attn.{name}.weight"]
        swapped[f"{prefix}.self_attn.{name}.weight"] = torch.cat(weight.chunk(2, dim=1)[::-1], dim=1)
    swapped_reference = ReferenceDraft(swapped, reference.config, reference.embedding, prefix)
    features = torch.randn(NUM_INGESTED, 3 * TARGET_HIDDEN, generator=torch.Generator().manual_seed(3))
    token_ids = list(range(10, 10 + NUM_INGESTED))
    ours = run_ours(model, features, token_ids, 1)
    assert (ours.logits - run_reference(reference, features, token_ids, 1).logits).abs().max() <= TOLERANCE
    assert (ours.logits - run_reference(swapped_reference, features, token_ids, 1).logits).abs().max() > 0.1


def test_to_target_ids_follows_d2t(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(draft_vocab_size=48))
    model, _ = load_eagle3(draft_dir)
    mapped = model.to_target_ids(torch.arange(48))
    assert mapped.tolist() == target_ids_of_draft(draft_dir)
    assert mapped.tolist() != list(range(48))  # the subset is not the first 48 ids, so d2t is really applied


def test_full_vocab_without_d2t_maps_to_itself(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec())
    tensors = load_file(str(draft_dir / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_eagle3(draft_dir)
    assert model.to_target_ids(torch.tensor([0, 7, 319])).tolist() == [0, 7, 319]


@pytest.mark.parametrize("location", ["eagle_config", "top_level"])
def test_config_fields(target_dir: Path, tmp_path: Path, location: str) -> None:
    spec = TinyEagle3Spec(
        hidden_size=96,
        num_heads=6,
        num_kv_heads=3,
        head_dim=8,
        draft_vocab_size=48,
        layer_ids=[1, 2, 3],
        layer_ids_location=location,  # type: ignore[arg-type]
        fc_norm=True,
        norm_before_fc=True,
        norm_output=True,
    )
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, spec)
    config = Eagle3Config.from_hf(json.loads((draft_dir / "config.json").read_text()))
    assert config.hidden_size == 96
    assert config.target_hidden_size == 64
    assert config.draft_vocab_size == 48
    assert config.layer.vocab_size == 320
    assert (config.layer.num_heads, config.layer.num_kv_heads, config.layer.head_dim) == (6, 3, 8)
    assert config.layer.rope.theta == ROPE_THETA
    assert (config.num_aux, config.aux_layer_ids) == (3, (1, 2, 3))
    assert (config.fc_norm, config.norm_before_fc, config.norm_output) == (True, True, True)


def test_config_defaults(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec())
    config = Eagle3Config.from_hf(json.loads((draft_dir / "config.json").read_text()))
    assert config.target_hidden_size == config.hidden_size == 64
    assert config.draft_vocab_size == 320
    assert (config.num_aux, config.aux_layer_ids) == (3, None)
    assert (config.fc_norm, config.norm_before_fc, config.norm_output) == (False, False, False)


def test_num_aux_from_config_key(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3(tmp_path, target_dir, TinyEagle3Spec(num_aux=2))
    model, _ = load_eagle3(draft_dir)
    assert model.config.num_aux == 2
    assert model.fc.weight.shape == (64, 128)
