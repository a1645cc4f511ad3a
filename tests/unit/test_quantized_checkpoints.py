"""Quantized checkpoints (tandem.weights.formats, quantized; tandem.layers.stored): block-wise fp8 as DeepSeek-V3 and
Kimi-K2 ship, compressed-tensors pack-quantized INT4 as Kimi-K2.5 ships its routed experts.

Small tensors against the formats' definitions (and fixed words of compressed-tensors' packing); tiny DeepSeek-V3 and
Kimi-K2.5 checkpoints quantized by the formats' rules (tests.helpers.quantized_checkpoints), whose weights, kept as
stored (expanded) or dequantized at load, must equal the reference dequantization exactly and whose greedy output must
equal transformers' on that dequantization; a rank's slice of the stored form along whole blocks; refusals of what is
not supported, naming it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

from tandem.layers.linear import PackedLinear
from tandem.layers.matmul import Linear
from tandem.layers.stored import StoredWeight
from tandem.models.config import ConfigError
from tandem.models.deepseek_v3 import DeepseekV3Config
from tandem.models.mtp import load_mtp
from tandem.models.registry import load_target
from tandem.parallel.layers import ShardSpec
from tandem.weights.formats import (
    FP8_AS_FLOAT16,
    BlockFp8,
    QuantizationError,
    QuantizedTensor,
    dequantize_block_fp8,
    dequantize_packed_int4,
    fp8_as_float16,
    int4_values_into,
)
from tandem.weights.loader import checkpoint_tensors, on_meta
from tandem.weights.quantized import quantization_of
from tests.helpers.deepseek_checkpoints import DEEPSEEK_NEXTN, TinyDeepseekSpec, write_tiny_deepseek
from tests.helpers.kimi_checkpoints import write_tiny_kimi_k25
from tests.helpers.parity import token_ids
from tests.helpers.quantized_checkpoints import (
    dequantize_block_fp8_reference,
    fp8_config,
    int4_config,
    pack_int4,
    quantize_block_fp8,
    quantize_int4,
    write_fp8,
    write_int4_experts,
)
from tests.unit.test_deepseek_v3 import kimi_k2_config
from tests.unit.test_gemma4 import NEW_TOKENS, served_greedy, transformers_greedy

SPEC = TinyDeepseekSpec(num_layers=3)
# Smaller than the releases' (128 x 128 blocks, groups of 32) so that the tiny weights span several blocks and groups,
# with partial edge blocks: kv_a_proj_with_mqa is [40, 64], q_b_proj [96, 32], o_proj [64, 64].
FP8_BLOCK = (16, 24)
INT4_GROUP = 16


def int4_values(packed: torch.Tensor, columns: int) -> torch.Tensor:  # [rows, words] int32 -> [rows, columns] int8
    values = torch.empty((packed.shape[0], columns))
    int4_values_into(packed, values)
    return values.to(torch.int8)


def test_int4_packing_matches_compressed_tensors_words() -> None:
    # Words produced by compressed-tensors' pack_to_int32 (0.20.0) for these values: nibble k of word w holds column
    # 8 * w + k, as q + 8, least significant first; unused nibbles of the last word are 0.
    ramp = torch.arange(-8, 8, dtype=torch.int8)[None]  # [1, 16]
    assert pack_int4(ramp).tolist() == [[0x76543210, 0xFEDCBA98 - (1 << 32)]]
    assert torch.equal(int4_values(torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)]], dtype=torch.int32), 16), ramp)
    odd = torch.tensor([[1, 7, -8, 0, 3, -1, 2, -5, 6, 4, -3]], dtype=torch.int8)
    assert pack_int4(odd).tolist() == [[981172473, 1486]]
    assert torch.equal(int4_values(torch.tensor([[981172473, 1486]], dtype=torch.int32), 11), odd)


def test_int4_dequantization_follows_the_format() -> None:
    weight = torch.randn((6, 45), generator=torch.Generator().manual_seed(0))
    q, scale = quantize_int4(weight, INT4_GROUP)  # 45 columns: 3 groups, the last one partial
    packed = pack_int4(q)
    assert torch.equal(int4_values(packed, 45), q)
    ours = dequantize_packed_int4(packed, scale, (6, 45), INT4_GROUP)
    expected = torch.stack([q[:, c].float() * scale[:, c // INT4_GROUP].float() for c in range(45)], dim=1)
    assert torch.equal(ours, expected)
    # At the scales' dtype this is compressed-tensors' decompression: q in the scale's dtype times the scale.
    columns = slice(0, 2 * INT4_GROUP)
    assert torch.equal(
        ours[:, columns].bfloat16(), q[:, columns].bfloat16() * scale.repeat_interleave(INT4_GROUP, 1)[:, columns]
    )


def test_fp8_values_moved_into_float16_are_torchs_conversion_over_256_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()  # [256], the two NaN codes (0x7F, 0xFF) among them
    moved = fp8_as_float16(codes.view(torch.float8_e4m3fn)).float() * FP8_AS_FLOAT16
    numbers = ~values.isnan()
    assert numbers.sum() == 254 and torch.equal(moved[numbers], values[numbers])  # subnormals and both zeros too
    assert torch.equal(moved[numbers].view(torch.int32), values[numbers].view(torch.int32))  # -0.0 stays -0.0


def test_fp8_dequantization_follows_the_format_at_partial_edge_blocks() -> None:
    weight = torch.randn((40, 70), generator=torch.Generator().manual_seed(1))
    fp8, scale_inv = quantize_block_fp8(weight, FP8_BLOCK)
    assert scale_inv.shape == (3, 3)
    ours = dequantize_block_fp8(fp8, scale_inv, FP8_BLOCK)
    assert torch.equal(ours, dequantize_block_fp8_reference(fp8, scale_inv, FP8_BLOCK))
    assert (ours - weight).abs().max() <= weight.abs().max() / 8  # fp8 keeps 3 mantissa bits


def test_a_stack_of_packed_experts_kept_as_stored_expands_part_by_part_and_expert_by_expert() -> None:
    # gate/up of 2 experts, 20 rows each (a partial 16-row block at each part's end), 40 input columns: each part of
    # each expert is its own stored weight with its own block grid.
    generator = torch.Generator().manual_seed(2)
    layer = on_meta(lambda: PackedLinear(40, {"gate": 20, "up": 20}, bias=False, experts=2))
    layer.keep_stored(StoredWeight(BlockFp8(FP8_BLOCK), {"gate": 20, "up": 20}, 40, torch.float32, "cpu", experts=2))
    expected = {}
    for part in ("gate", "up"):
        stored = [quantize_block_fp8(torch.randn((20, 40), generator=generator), FP8_BLOCK) for _ in range(2)]
        assert layer.stored is not None
        layer.stored.load(part, {"weight": torch.stack([fp8 for fp8, _ in stored]),
                                 "weight_scale_inv": torch.stack([scale for _, scale in stored])})  # fmt: skip
        expected[part] = [dequantize_block_fp8_reference(fp8, scale, FP8_BLOCK) for fp8, scale in stored]
    for part in ("gate", "up"):
        for expert in range(2):
            assert torch.equal(layer.expert_rows(part, expert), expected[part][expert])
    # The whole weight in the layer's row order: gate (expert 0, expert 1), then up.
    assert torch.equal(layer.float_weight(), torch.cat([*expected["gate"], *expected["up"]]))
    assert dict(layer.named_parameters()) == {} and len(dict(layer.named_buffers())) == 4  # no float weight held


@pytest.fixture(scope="module")
def float_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("float"), SPEC)


@pytest.fixture(scope="module")
def fp8_dirs(float_deepseek: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    write_fp8(float_deepseek, root / "fp8", root / "reference", FP8_BLOCK)
    return root / "fp8", root / "reference"


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("int4")
    write_int4_experts(write_tiny_kimi_k25(root / "float", SPEC), root / "int4", root / "reference", INT4_GROUP)
    return root / "int4", root / "reference"


def assert_loads_as_the_reference(quantized: Path, reference: Path, dtype: torch.dtype) -> list[str]:
    """Dequantized at load, every tensor equals the reference's; kept as stored, every float tensor does and every
    stored weight expands to the reference's weight. Returns the layers whose weights are kept as stored."""
    expected = load_target(reference, dtype=dtype)
    dequantized = load_target(quantized, dtype=dtype, dequantize=True)
    kept = load_target(quantized, dtype=dtype)
    assert isinstance(expected, torch.nn.Module) and isinstance(dequantized, torch.nn.Module)
    assert isinstance(kept, torch.nn.Module)
    expected_state = expected.state_dict()
    for name, tensor in dequantized.state_dict().items():
        assert tensor.dtype == expected_state[name].dtype, name
        assert torch.equal(tensor, expected_state[name]), name
    stored = [name for name, layer in kept.named_modules() if isinstance(layer, Linear) and layer.stored is not None]
    for name in stored:
        weight = kept.get_submodule(name).float_weight()
        assert weight.dtype == dtype and torch.equal(weight, expected_state[name + ".weight"]), name
    for name, tensor in kept.state_dict().items():
        if ".stored." not in name:
            assert torch.equal(tensor, expected_state[name]), name
    return stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_load_as_the_reference_dequantization(fp8_dirs: tuple[Path, Path], dtype: torch.dtype) -> None:
    quantized, reference = fp8_dirs
    stored = load_file(str(quantized / "model.safetensors"))
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 3)
    kept = assert_loads_as_the_reference(quantized, reference, dtype)
    # Every projection of the decoder layers (3 layers of q_a, q_b, kv_a, kv_b, o; a dense MLP, then 8 routed experts
    # and a shared one, gate/up and down each), not the head.
    assert len(kept) == 3 * 5 + 2 + 2 * (9 * 2) and all(name.startswith("model.layers.") for name in kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_experts_load_as_the_reference_dequantization(int4_dirs: tuple[Path, Path], dtype: torch.dtype) -> None:
    quantized, reference = int4_dirs
    stored = load_file(str(quantized / "model.safetensors"))
    prefix = "language_model.model.blocks.1.mlp.experts.3.gate_proj."
    assert stored[prefix + "weight_packed"].shape == (32, 8) and prefix + "weight" not in stored
    assert "language_model.model.blocks.1.mlp.shared_experts.gate_proj.weight" in stored  # left in float
    kept = assert_loads_as_the_reference(quantized, reference, dtype)
    assert len(kept) == 2 * 8 * 2 and all(".mlp.experts." in name for name in kept)  # 2 MoE layers' routed experts


def test_fp8_greedy_equals_transformers_kept_as_stored_and_dequantized(
    fp8_dirs: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    quantized, reference = fp8_dirs
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    prompt = token_ids(13, seed=7)
    expected = transformers_greedy(model, prompt, NEW_TOKENS)
    # Kimi-K2 ships the same fp8 layout under its own config.json (model_type kimi_k2, rope in the older form).
    kimi_k2 = edited(quantized, tmp_path, kimi_k2_config)
    for directory in (quantized, kimi_k2):
        for dequantize in (False, True):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="target_server.main"):
                assert served_greedy(directory, prompt, NEW_TOKENS, dequantize) == expected, (directory, dequantize)
            # The start-up line: the weights by kind (the fp8 parts take 0.2 MiB), the KV pool's capacity.
            (line,) = [record.getMessage() for record in caplog.records if "weights per rank" in record.getMessage()]
            stored = "0.0 MiB quantized as stored" if dequantize else "0.2 MiB quantized as stored"
            assert stored in line and "KV cache: 64 blocks of 4 tokens (256 tokens)" in line, line


def test_int4_kimi_k25_greedy_equals_transformers_kept_as_stored_and_dequantized(int4_dirs: tuple[Path, Path]) -> None:
    quantized, reference = int4_dirs
    model = Kimi_K25ForConditionalGeneration.from_pretrained(reference, dtype=torch.float32).eval()
    prompt = token_ids(13, seed=8)
    expected = transformers_greedy(model, prompt, NEW_TOKENS)
    for dequantize in (False, True):
        assert served_greedy(quantized, prompt, NEW_TOKENS, dequantize) == expected, dequantize


def test_nextn_layers_of_an_fp8_checkpoint_load_as_the_reference_dequantization(tmp_path: Path) -> None:
    # The MTP draft reads DeepSeek-V3's NextN layers (fp8 as the release ships them) from the target's directory and
    # holds them dequantized: its own layers are few and small.
    write_fp8(
        write_tiny_deepseek(tmp_path / "float", DEEPSEEK_NEXTN), tmp_path / "fp8", tmp_path / "reference", FP8_BLOCK
    )
    assert "model.layers.2.eh_proj.weight_scale_inv" in load_file(str(tmp_path / "fp8" / "model.safetensors"))
    ours, expected = load_mtp(tmp_path / "fp8").model.state_dict(), load_mtp(tmp_path / "reference").model.state_dict()
    assert ours.keys() == expected.keys() and all(torch.equal(ours[name], expected[name]) for name in expected)


def test_quantized_weights_slice_for_tensor_parallel_shards(fp8_dirs: tuple[Path, Path]) -> None:
    quantized, reference = fp8_dirs
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [40, 64] in 16 x 24 blocks: a [3, 3] grid
    expected = load_file(str(reference / "model.safetensors"))[name]
    stored = load_file(str(quantized / "model.safetensors"))
    by_rows, by_columns = ShardSpec((40, 64), dim=0, start=10, size=20), ShardSpec((40, 64), dim=1, start=32, size=32)
    with checkpoint_tensors(quantized) as tensors:
        (weight,) = [tensor for tensor_name, tensor in tensors if tensor_name == name]
        assert isinstance(weight, QuantizedTensor) and weight.shape == (40, 64)
        # Dequantized, any slice: the whole weight is dequantized, then cut.
        assert torch.equal(weight.read(by_rows), expected[10:30])
        assert torch.equal(weight.read(by_columns), expected[:, 32:])
        # As stored, whole blocks: rows [16, 40) (the last block partial, where the weight ends) take scale rows 1..2.
        parts = weight.read_stored(ShardSpec((40, 64), dim=0, start=16, size=24))
        assert torch.equal(parts["weight"].view(torch.uint8), stored[name][16:].view(torch.uint8))
        assert torch.equal(parts["weight_scale_inv"], stored[name + "_scale_inv"][1:])
        with pytest.raises(QuantizationError, match=r"weight: rows 20 per rank is not a multiple of the 16-row fp8"):
            weight.read_stored(by_rows)
        with pytest.raises(
            QuantizationError, match=r"columns 32 per rank is not a multiple of the 24-column fp8 block"
        ):
            weight.read_stored(by_columns)


def edited(directory: Path, tmp_path: Path, edit: Any) -> Path:
    copy = shutil.copytree(directory, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(edit(config)))
    return copy


def test_missing_scales_are_refused_naming_the_tensor(fp8_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    copy = shutil.copytree(fp8_dirs[0], tmp_path / "no-scale")
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    # The weight is still float8: without its scales it is refused, not cast.
    with pytest.raises(
        QuantizationError, match=r"^tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight: stored as F8_E4M3"
    ):
        load_target(copy)


def test_a_missing_int4_part_is_refused_naming_it(int4_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    copy = shutil.copytree(int4_dirs[0], tmp_path / "no-scale")
    tensors = load_file(str(copy / "model.safetensors"))
    prefix = "language_model.model.blocks.2.mlp.experts.0.down_proj."
    del tensors[prefix + "weight_scale"]
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="^" + re.escape(f"tensor {prefix}weight_scale: missing")):
        load_target(copy)


def test_a_float8_checkpoint_without_quantization_config_is_refused(
    fp8_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    copy = edited(fp8_dirs[0], tmp_path, lambda config: {k: v for k, v in config.items() if k != "quantization_config"})
    with pytest.raises(QuantizationError, match=r"stored as F8_E4M3 with no scales"):
        load_target(copy)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method: 'gptq'"),
        ({"quant_method": "awq"}, "quantization_config.quant_method: 'awq'"),
        (fp8_config((128, 128)) | {"weight_block_size": None}, "quantization_config.weight_block_size: None"),
        (fp8_config((128, 128)) | {"fmt": "e5m2"}, "quantization_config.fmt: 'e5m2'"),
        (fp8_config((128, 128)) | {"activation_scheme": "static"}, "quantization_config.activation_scheme: 'static'"),
        (int4_config(32) | {"format": "float-quantized"}, "config_groups.group_0.format: 'float-quantized'"),
        (int4_config(32) | {"quantization_status": "frozen"}, "quantization_config.quantization_status: 'frozen'"),
    ],
)
def test_unsupported_quantization_is_refused_naming_it(config: dict[str, Any], named: str) -> None:
    with pytest.raises(QuantizationError) as error:
        quantization_of({"quantization_config": config})
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_bits", 8),
        ("symmetric", False),
        ("strategy", "channel"),
        ("type", "float"),
        ("actorder", "group"),
        ("dynamic", True),
    ],
)
def test_unsupported_int4_weight_schemes_are_refused_naming_the_key(key: str, value: Any) -> None:
    config = int4_config(32)
    config["config_groups"]["group_0"]["weights"][key] = value
    with pytest.raises(QuantizationError, match=rf"config_groups\.group_0\.weights\.{key}: {value!r}"):
        quantization_of({"text_config": {"quantization_config": config}})


def test_deepseek_config_accepts_what_the_loader_reads(float_deepseek: Path) -> None:
    hf = json.loads((float_deepseek / "config.json").read_text())
    DeepseekV3Config.from_hf(hf | {"quantization_config": fp8_config((128, 128))})
    DeepseekV3Config.from_hf(hf | {"quantization_config": int4_config(32)})
    with pytest.raises(ConfigError, match=r"^quantization_config\.quant_method: 'bitsandbytes'"):
        DeepseekV3Config.from_hf(hf | {"quantization_config": {"quant_method": "bitsandbytes"}})
