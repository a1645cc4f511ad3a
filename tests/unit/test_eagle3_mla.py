"""The EAGLE3 MLA head (Eagle3DeepseekV2ForCausalLM) against an independent dense reference written here.

The reference is plain torch over the checkpoint's tensors and config.json, written from REFERENCE.md ("EAGLE3 draft
checkpoints", "EAGLE3 with MLA attention") and DeepSeek-V3's attention: separate q_a_proj and kv_a_proj_with_mqa over
concat([input_layernorm(embed), hidden_norm(hidden)]), full per-head K and V up-projections of the latent by kv_b_proj
(no absorption), rope on the shared key part in the checkpoint's own pair layout, a causal mask, no cache; every row
is recomputed from scratch. Our model runs absorbed attention over the compressed paged cache, through the draft
runner's real path (DraftRunner.propose: batched ingest, chain steps, truncation at the next round).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from draft_server.compat import check_compatibility
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from tandem.layers.kv_cache import CacheLayout
from tandem.layers.mlp import GatedMLP
from tandem.models.config import ConfigError
from tandem.models.deepseek_v3 import DeepseekV3DecoderLayer
from tandem.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3
from tandem.settings import KVCacheSettings
from tandem.weights.loader import CheckpointError
from tandem.wire import target_pb2
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.helpers.draft_reference import BLOCK_SIZE, run_ours, run_reference
from tests.helpers.eagle3_mla_checkpoints import TinyEagle3MLASpec, write_tiny_eagle3_mla

TOLERANCE = 1e-4
CACHE = KVCacheSettings(num_blocks=32, block_size=BLOCK_SIZE)
NUM_INGESTED = 6  # with 4 chain steps after it the draft spans 3 blocks
# Rope only sees position differences, and YaRN changes only the slow frequencies: over a few rows a draft that
# skipped YaRN's frequency rule would differ by less than TOLERANCE, over this many by far more.
LONG_INGESTED = 200
NUM_STEPS = 4
TARGET_HIDDEN = 64  # TinyTargetSpec's
TARGET_VOCAB = 320
LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm are built with the RMSNorm default

# Kimi-K2's own rope: theta 50000, YaRN factor 64 with beta_fast == beta_slow and mscale == mscale_all_dim.
KIMI_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    # DeepSeek-V3's YaRN (mscale_all_dim 0.8), interleaved rope by default, layers.0.* names, kimi_k2 model type.
    "kimi_k2-yarn-interleaved": TinyEagle3MLASpec(),
    "kimi_k2-kimi_rope": TinyEagle3MLASpec(rope_theta=50000.0, rope_scaling=KIMI_YARN, rope_interleave=True, seed=1),
    "deepseek_v3-midlayer-rotate_half": TinyEagle3MLASpec(
        model_type="deepseek_v3",
        weight_prefix="midlayer",
        rope_theta=500.0,
        rope_scaling=None,
        rope_interleave=False,
        layer_ids=(1, 2),
        num_aux=2,
        seed=2,
    ),
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


# The reference: plain functions of the checkpoint's tensors and config.json.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., size] -> [..., size]
    return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def reference_rope(config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim // 2], cos/sin scale) of DeepSeek-V3's rope with optional YaRN scaling."""
    dim, base = config["qk_rope_head_dim"], config["rope_theta"]
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.get("rope_scaling")
    if not scaling:
        return extrapolated.float(), 1.0
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    interpolate = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inverse = extrapolated / factor * interpolate + extrapolated * (1 - interpolate)
    scale = yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return inverse.float(), scale


def reference_softmax_scale(config: dict[str, Any]) -> float:
    scale: float = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def apply_rope(x: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """[rows, heads, rope_dim], row i at position i, rotated in the checkpoint's layout: adjacent pairs (2i, 2i + 1)
    when rope_interleave (DeepSeek-V3's default), else dimension i with i + rope_dim / 2."""
    inverse, scale = reference_rope(config)
    angles = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inverse[None, :]  # [rows, rope_dim // 2]
    cos, sin = angles.cos()[:, None, :] * scale, angles.sin()[:, None, :] * scale
    if config.get("rope_interleave", True):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@dataclass(frozen=True)
class ReferenceMLADraft:
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    prefix: str  # "layers.0" or "midlayer"

    def weight(self, name: str) -> torch.Tensor:
        return self.tensors[f"{self.prefix}.{name}"]

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [rows, num_aux * target_hidden] -> [rows, hidden]
        return features @ self.tensors["fc.weight"].T

    def attention_input(self, token_ids: list[int], residuals: torch.Tensor) -> torch.Tensor:  # -> [rows, 2 * hidden]
        eps = self.config["rms_norm_eps"]
        embedded = rms_norm(self.tensors["embed_tokens.weight"][token_ids], self.weight("input_layernorm.weight"), eps)
        return torch.cat([embedded, rms_norm(residuals, self.weight("hidden_norm.weight"), eps)], dim=-1)

    def latents(self, attention_input: torch.Tensor) -> torch.Tensor:  # [rows, 2 * hidden] -> [rows, kv_lora_rank]
        compressed = attention_input @ self.weight("self_attn.kv_a_proj_with_mqa.weight").T
        latent = compressed[:, : self.config["kv_lora_rank"]]
        return rms_norm(latent, self.weight("self_attn.kv_a_layernorm.weight"), LATENT_NORM_EPS)

    def rows(
        self,
        token_ids: list[int],  # target ids; row p takes token_ids[p]
        residuals: torch.Tensor,  # [rows, hidden]; row p sits at position p
    ) -> tuple[torch.Tensor, torch.Tensor]:  # carried hidden [rows, hidden], logits [rows, draft_vocab]
        config = self.config
        eps, heads = config["rms_norm_eps"], config["num_attention_heads"]
        nope, rope_dim, value_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
        num_rows = residuals.shape[0]
        x = self.attention_input(token_ids, residuals)
        query_latent = x @ self.weight("self_attn.q_a_proj.weight").T
        query_latent = rms_norm(query_latent, self.weight("self_attn.q_a_layernorm.weight"), LATENT_NORM_EPS)
        query = (query_latent @ self.weight("self_attn.q_b_proj.weight").T).view(num_rows, heads, nope + rope_dim)
        key_rope = (x @ self.weight("self_attn.kv_a_proj_with_mqa.weight").T)[:, config["kv_lora_rank"] :]
        # Full up-projection: every head's key (no-rope part) and value from the latent.
        up = (self.latents(x) @ self.weight("self_attn.kv_b_proj.weight").T).view(num_rows, heads, nope + value_dim)
        key_nope, value = up.split([nope, value_dim], dim=-1)
        query = torch.cat([query[..., :nope], apply_rope(query[..., nope:], config)], dim=-1)
        shared_key_rope = apply_rope(key_rope[:, None, :], config).expand(num_rows, heads, rope_dim)
        key = torch.cat([key_nope, shared_key_rope], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", query, key) * reference_softmax_scale(config)
        causal = torch.ones(num_rows, num_rows, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        attended = torch.einsum("hqk,khd->qhd", weights, value).reshape(num_rows, heads * value_dim)
        stream = residuals + attended @ self.weight("self_attn.o_proj.weight").T
        normed = rms_norm(stream, self.weight("post_attention_layernorm.weight"), eps)
        gate, up_part = normed @ self.weight("mlp.gate_proj.weight").T, normed @ self.weight("mlp.up_proj.weight").T
        stream = stream + (F.silu(gate) * up_part) @ self.weight("mlp.down_proj.weight").T
        logits = rms_norm(stream, self.tensors["norm.weight"], eps) @ self.tensors["lm_head.weight"].T
        return stream, logits

    def to_target_id(self, draft_id: int) -> int:
        return draft_id + int(self.tensors["d2t"][draft_id])


def load_pair(draft_dir: Path, spec: TinyEagle3MLASpec) -> tuple[Eagle3Draft, ReferenceMLADraft]:
    model, has_embedding = load_eagle3(draft_dir)
    assert has_embedding
    tensors = load_file(str(draft_dir / "model.safetensors"))
    config = json.loads((draft_dir / "config.json").read_text())
    return model, ReferenceMLADraft(tensors, config, spec.weight_prefix)


def random_rows(num_aux: int, length: int, seed: int, start_position: int = 0) -> TargetRows:
    generator = torch.Generator().manual_seed(seed)
    return TargetRows(
        start_position=start_position,
        next_tokens=torch.randint(3, TARGET_VOCAB, (length,), generator=generator).tolist(),
        features=torch.randn(length, num_aux * TARGET_HIDDEN, generator=generator),
    )


@pytest.mark.parametrize("num_ingested", [NUM_INGESTED, LONG_INGESTED])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_draft_matches_reference(variant: str, num_ingested: int, target_dir: Path, tmp_path: Path) -> None:
    spec = VARIANTS[variant]
    model, reference = load_pair(write_tiny_eagle3_mla(tmp_path, target_dir, spec), spec)
    rows = random_rows(spec.num_aux, num_ingested, seed=1)
    ours = run_ours(model, rows.features, list(rows.next_tokens), NUM_STEPS)
    expected = run_reference(reference, rows.features, list(rows.next_tokens), NUM_STEPS)

    assert ours.logits.dtype == torch.float32
    assert ours.logits.shape == (num_ingested + NUM_STEPS - 1, spec.draft_vocab_size)
    assert (ours.logits - expected.logits).abs().max().item() <= TOLERANCE
    assert (ours.hidden - expected.hidden).abs().max().item() <= TOLERANCE
    assert ours.proposed == expected.proposed


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_runner_chain_matches_reference(variant: str, target_dir: Path, tmp_path: Path) -> None:
    """Two requests batched through DraftRunner.propose, then a second round of the first one, which truncates its
    speculative cache rows and ingests the next committed rows: the proposals are the reference's greedy chains."""
    spec = VARIANTS[variant]
    model, reference = load_pair(write_tiny_eagle3_mla(tmp_path, target_dir, spec), spec)
    runner = DraftRunner(model, CACHE)
    first, second = random_rows(spec.num_aux, NUM_INGESTED, seed=2), random_rows(spec.num_aux, 3, seed=3)
    proposals = runner.propose([ProposeInput("a", first, NUM_STEPS), ProposeInput("b", second, 2)])
    assert proposals == [
        run_reference(reference, first.features, list(first.next_tokens), NUM_STEPS).proposed,
        run_reference(reference, second.features, list(second.next_tokens), 2).proposed,
    ]

    later = random_rows(spec.num_aux, 3, seed=4, start_position=NUM_INGESTED)
    [proposal] = runner.propose([ProposeInput("a", later, 3)])
    features = torch.cat([first.features, later.features])
    assert proposal == run_reference(reference, features, [*first.next_tokens, *later.next_tokens], 3).proposed


def test_cache_holds_one_latent_row_per_token(target_dir: Path, tmp_path: Path) -> None:
    spec = TinyEagle3MLASpec()
    model, reference = load_pair(write_tiny_eagle3_mla(tmp_path, target_dir, spec), spec)
    row_width = spec.kv_lora_rank + spec.qk_rope_head_dim
    assert model.config.cache_layout == CacheLayout(num_kv_heads=1, key_dim=row_width, value_dim=0)
    runner = DraftRunner(model, CACHE)
    assert runner.cache.keys.shape == (1, CACHE.num_blocks * BLOCK_SIZE, 1, row_width)
    assert runner.cache.values.shape == (1, CACHE.num_blocks * BLOCK_SIZE, 1, 0)

    rows = random_rows(spec.num_aux, NUM_INGESTED, seed=5)
    runner.propose([ProposeInput("a", rows, 1)])
    # Each ingested position's row starts with the normalized latent of its attention input.
    slots = runner.cache.slots(runner.requests["a"].kv, 0, NUM_INGESTED)
    cached = runner.cache.keys[0, slots, 0, : spec.kv_lora_rank]
    attention_input = reference.attention_input(list(rows.next_tokens), reference.project(rows.features))
    assert (cached - reference.latents(attention_input)).abs().max().item() <= TOLERANCE


def test_reference_rope_matches_transformers() -> None:
    # Guards the reference's YaRN (written from DeepSeek's conventions) against transformers' implementation.
    for scaling in (TinyEagle3MLASpec().rope_scaling, KIMI_YARN):
        assert scaling is not None
        theta = 50000.0 if scaling is KIMI_YARN else 10000.0
        transformers_config = DeepseekV3Config(
            hidden_size=48,
            num_attention_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_parameters={"rope_theta": theta, **scaling, "rope_type": "yarn"},
            max_position_embeddings=163840,
        )
        expected_inverse, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](transformers_config)
        inverse, scale = reference_rope({"qk_rope_head_dim": 8, "rope_theta": theta, "rope_scaling": scaling})
        torch.testing.assert_close(inverse, expected_inverse.float())
        assert scale == pytest.approx(expected_scale)


def test_fused_down_projection_and_dense_mlp(target_dir: Path, tmp_path: Path) -> None:
    spec = TinyEagle3MLASpec()
    model, reference = load_pair(write_tiny_eagle3_mla(tmp_path, target_dir, spec), spec)
    layer = model.layer
    assert isinstance(layer, DeepseekV3DecoderLayer)
    attention = layer.self_attn
    fused = torch.cat(
        [reference.weight("self_attn.q_a_proj.weight"), reference.weight("self_attn.kv_a_proj_with_mqa.weight")]
    )
    assert attention.fused_qkv_a_proj_with_mqa is not None
    assert torch.equal(attention.fused_qkv_a_proj_with_mqa.weight, fused)  # q rows first
    assert attention.q_a_proj is None and attention.kv_a_proj_with_mqa is None
    # The config's MoE keys (first_k_dense_replace 0) would make a target's layer 0 MoE; the head's MLP is dense.
    assert isinstance(layer.mlp, GatedMLP)


@pytest.mark.parametrize("omit", [False, True], ids=["null", "absent"])
def test_missing_q_lora_rank_is_refused(target_dir: Path, tmp_path: Path, omit: bool) -> None:
    draft_dir = write_tiny_eagle3_mla(tmp_path, target_dir, TinyEagle3MLASpec(q_lora_rank=None, omit_q_lora_rank=omit))
    with pytest.raises(ConfigError, match="q_lora_rank: missing or null"):
        load_eagle3(draft_dir)


def test_q_a_proj_of_wrong_width_is_refused(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3_mla(tmp_path, target_dir)
    tensors = load_file(str(draft_dir / "model.safetensors"))
    name = "layers.0.self_attn.q_a_proj.weight"
    tensors[name] = tensors[name][:, :48].contiguous()  # hidden wide instead of 2 * hidden
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} in .*expected shape \(24, 96\), got \(24, 48\)"):
        load_eagle3(draft_dir)


def test_missing_kv_a_proj_is_named(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3_mla(tmp_path, target_dir, TinyEagle3MLASpec(weight_prefix="midlayer"))
    tensors = load_file(str(draft_dir / "model.safetensors"))
    del tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"]
    save_file(tensors, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor midlayer\.self_attn\.kv_a_proj_with_mqa\.weight"):
        load_eagle3(draft_dir)


def test_more_than_one_layer_is_refused(target_dir: Path, tmp_path: Path) -> None:
    draft_dir = write_tiny_eagle3_mla(tmp_path, target_dir)
    config = json.loads((draft_dir / "config.json").read_text())
    (draft_dir / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_eagle3(draft_dir)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_config_exposes_the_same_fields_for_both_kinds(target_dir: Path, tmp_path: Path, kind: str) -> None:
    if kind == "llama":
        spec = TinyEagle3Spec(hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=8, draft_vocab_size=48)
        draft_dir = write_tiny_eagle3(tmp_path, target_dir, replace(spec, layer_ids=(1, 2, 3)))
        hidden, layout = 96, CacheLayout(num_kv_heads=3, key_dim=8, value_dim=8)
    else:
        draft_dir = write_tiny_eagle3_mla(tmp_path, target_dir, TinyEagle3MLASpec(layer_ids=(1, 2, 3)))
        hidden, layout = 48, CacheLayout(num_kv_heads=1, key_dim=24, value_dim=0)
    config = Eagle3Config.from_hf(json.loads((draft_dir / "config.json").read_text()))
    assert (config.hidden_size, config.target_hidden_size) == (hidden, TARGET_HIDDEN)
    assert (config.vocab_size, config.draft_vocab_size) == (TARGET_VOCAB, 48)
    assert (config.num_aux, config.aux_layer_ids) == (3, (1, 2, 3))
    assert (config.fc_norm, config.norm_before_fc, config.norm_output) == (False, False, False)
    assert config.cache_layout == layout
    # The draft's own embedding lets it serve a target of another width.
    target = target_pb2.TargetInfo(hidden_size=TARGET_HIDDEN, vocab_size=TARGET_VOCAB)
    check_compatibility(config, target, has_embedding=True)
