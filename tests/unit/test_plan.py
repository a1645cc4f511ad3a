"""`tandem plan` (tandem.models.memory_plan, launch.plan_report): per-rank weights and KV from config.json and the
safetensors headers alone.

The planned bytes are checked against the files read normally (tp 1: every tensor the target reads, as stored),
against what the loader holds on each rank (load_target with a rank's ParallelGroup: no process group is needed to
load a shard), against hand-computed slices of quantized weights at tp 2, and against the KV pool the target builds.
A checkpoint with its data section cut off plans the same; DeepSeek-V3 at full size plans from headers alone.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from launch.cli import main
from tandem.layers.matmul import ONEDNN, Linear, prepack
from tandem.models.memory_plan import CutBlock, MemoryPlan, plan_memory
from tandem.models.registry import TargetModel, check_tensor_parallel, load_target
from tandem.parallel.group import ParallelGroup
from tandem.settings import KVCacheSettings
from tandem.weights.formats import QuantizationError
from tandem.weights.headers import checkpoint_headers
from target_server.ranks import build_cache
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.deepseek_checkpoints import DEEPSEEK_NEXTN, TinyDeepseekSpec, write_tiny_deepseek
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.helpers.header_checkpoints import deepseek_v3_config, deepseek_v3_tensors, write_header_only
from tests.helpers.kimi_checkpoints import HUB_TOWERS, to_hub_layout, write_tiny_kimi_k25
from tests.helpers.quantized_checkpoints import int4_config, pack_int4, quantize_int4, write_fp8, write_int4_experts

GROUP = 16  # INT4 group; with 16 x 16 fp8 blocks, every tp-2 split of the tiny Llama falls on a boundary
BLOCK_SIZE = KVCacheSettings.block_size
H200_BYTES = 141_000_000_000
# What the target says when tp 2 would cut the 48 x 48 fp8 blocks of "llama-fp8-cut" (down_proj is met first).
CUT_DOWN_PROJ = (
    r"^tensor model\.layers\.0\.mlp\.down_proj\.weight: columns 64 per rank is not a multiple of the 48-column fp8 "
    r"block"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints by name; vocabularies that 64 does not divide leave the last rank fewer table rows."""
    root = tmp_path_factory.mktemp("plan")
    llama = write_tiny_target(root / "llama", TinyTargetSpec(vocab_size=330))
    found = {
        "llama": llama,
        "llama-sharded-tied": write_tiny_target(
            root / "llama-sharded-tied", TinyTargetSpec(vocab_size=330, sharded=True, tie_word_embeddings=True)
        ),
        "gemma3": write_tiny_gemma3(root / "gemma3", TinyGemma3Spec(vocab_size=330)),
        "llama-int4": write_int4_projections(llama, root / "llama-int4", GROUP),
    }
    for name, block in (("llama-fp8", (16, 16)), ("llama-fp8-cut", (48, 48))):
        write_fp8(llama, root / name, root / f"{name}-reference", block)
        found[name] = root / name
    deepseek = write_tiny_deepseek(root / "deepseek", DEEPSEEK_NEXTN)
    write_fp8(deepseek, root / "deepseek-fp8", root / "deepseek-fp8-reference", (16, 24))
    kimi = to_hub_layout(write_tiny_kimi_k25(root / "kimi", TinyDeepseekSpec(num_layers=2)))
    write_int4_experts(kimi, root / "kimi-int4", root / "kimi-int4-reference", GROUP)
    return found | {"deepseek-fp8": root / "deepseek-fp8", "kimi-int4": root / "kimi-int4"}


def write_int4_projections(source: Path, directory: Path, group: int) -> Path:
    """Every projection of the decoder layers as compressed-tensors pack-quantized INT4 (a Llama: at tp 2 its splits
    cut rows of gate/up/q/k/v and columns of o_proj/down_proj)."""
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if ".layers." not in name or not name.endswith("_proj.weight"):
            stored[name] = tensor
            continue
        q, scale = quantize_int4(tensor, group)
        prefix = name.removesuffix("weight")
        stored[prefix + "weight_packed"] = pack_int4(q)
        stored[prefix + "weight_scale"] = scale
        stored[prefix + "weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
    shutil.copytree(source, directory)
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text()) | {"quantization_config": int4_config(group)}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def planned(directory: Path, tp: int, dtype: str = "float32", device: str = "cpu") -> MemoryPlan:
    config = json.loads((directory / "config.json").read_text())
    return plan_memory(config, checkpoint_headers(directory), tp, dtype, device, str(directory))


def stored_bytes(directory: Path, keep: Callable[[str], bool] = lambda name: True) -> dict[str, int]:
    """Each tensor's bytes, read from the files the ordinary way."""
    sizes = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if keep(name):
                    tensor = handle.get_tensor(name)
                    sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


def held(model: TargetModel) -> list[torch.Tensor]:
    """The parameters and buffers a loaded model holds, a tied table once."""
    assert isinstance(model, torch.nn.Module)
    return [*model.parameters(), *model.buffers()]


def held_bytes(model: TargetModel) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in held(model))


def is_kept(name: str) -> bool:
    """A tensor the target holds: every one but INT4's weight_shape (the layer's own shape gives it)."""
    return not name.endswith("weight_shape")


def prepacked_bytes(model: TargetModel) -> dict[str, int]:
    """The bytes of the oneDNN copy `prepack` makes of each linear layer's weight, by layer name."""
    assert isinstance(model, torch.nn.Module)
    prepack(model)
    return {
        name: module.prepacked.nbytes
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.prepacked is not None
    }


def pool_token_bytes(model: TargetModel) -> int:
    """What the target's own KV pool allocates per token (three blocks, every layer)."""
    settings = KVCacheSettings(num_blocks=3, block_size=4)
    cache = build_cache(model, settings)
    return (cache.keys.nbytes + cache.values.nbytes) // (settings.num_blocks * settings.block_size)


def is_quantized_part(name: str) -> bool:
    return name.endswith(("weight_scale_inv", "weight_packed", "weight_scale", "weight_shape")) or (
        ".layers." in name and name.endswith("_proj.weight")
    )


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("llama", lambda name: True),
        ("llama-sharded-tied", lambda name: True),
        ("gemma3", lambda name: True),
        ("llama-fp8", lambda name: True),
        ("llama-int4", lambda name: True),
        ("deepseek-fp8", lambda name: not name.startswith("model.layers.2.")),  # the NextN layer
        ("kimi-int4", lambda name: not name.startswith(HUB_TOWERS)),
    ],
)
def test_at_tp_1_the_weights_are_the_stored_bytes_of_what_the_target_reads(
    checkpoints: dict[str, Path], name: str, read: Callable[[str], bool]
) -> None:
    directory = checkpoints[name]
    plan = planned(directory, tp=1)
    (rank,) = plan.ranks
    stored = sum(stored_bytes(directory, lambda tensor: read(tensor) and is_kept(tensor)).values())
    assert rank.quantized_bytes + rank.float_bytes == stored
    assert plan.skipped_bytes == sum(stored_bytes(directory, lambda tensor: not read(tensor)).values())
    # Kept as stored (the default), the target holds exactly the stored bytes; dequantized, the plan's other count.
    assert held_bytes(load_target(directory)) == stored
    model = load_target(directory, dequantize=True)
    assert rank.dequantized_bytes == held_bytes(model)
    assert plan.parameters == sum(tensor.numel() for tensor in held(model))
    assert rank.kv_token_bytes == pool_token_bytes(model)
    assert plan.cuts == ()


@pytest.mark.parametrize("name", ["llama", "llama-sharded-tied", "gemma3", "llama-fp8", "llama-fp8-cut", "llama-int4"])
def test_at_tp_2_each_rank_holds_what_the_loader_loads_on_it(checkpoints: dict[str, Path], name: str) -> None:
    plan = planned(checkpoints[name], tp=2)
    for rank in plan.ranks:
        group = ParallelGroup(rank=rank.rank, world_size=2)
        model = load_target(checkpoints[name], group=group, dequantize=True)
        assert rank.dequantized_bytes == held_bytes(model)
        assert rank.kv_token_bytes == pool_token_bytes(model)
        if name == "llama-fp8-cut":  # kept as stored, refused: tp 2 cuts the 48 x 48 blocks
            with pytest.raises(QuantizationError, match=CUT_DOWN_PROJ):
                load_target(checkpoints[name], group=group)
        else:
            assert rank.quantized_bytes + rank.float_bytes == held_bytes(load_target(checkpoints[name], group=group))


@pytest.mark.parametrize("name", ["llama", "llama-sharded-tied", "llama-fp8", "llama-int4"])
def test_on_the_cpu_in_float32_each_rank_counts_the_copies_prepack_makes(
    checkpoints: dict[str, Path], name: str
) -> None:
    # The quantized checkpoints quantize every projection of the decoder layers: the copies of their dequantized
    # weights count only with --dequantize; the LM head (the embedding's table, when tied) is copied in both forms.
    plan = planned(checkpoints[name], tp=2)
    for rank in plan.ranks:
        group = ParallelGroup(rank=rank.rank, world_size=2)
        copied = {dequantize: prepacked_bytes(load_target(checkpoints[name], group=group, dequantize=dequantize))
                  for dequantize in (True, False)}  # fmt: skip
        assert (sum(copied[True].values()) > 0) == ONEDNN
        assert rank.dequantized_copy_bytes == sum(copied[True].values())
        # Kept as stored, the quantized weights (every projection of the decoder layers) get no copy.
        quantized = name != "llama" and name != "llama-sharded-tied"
        assert all(not quantized or ".layers." not in module_name for module_name in copied[False])
        assert rank.float_copy_bytes == sum(copied[False].values())
        assert rank.weight_bytes(dequantize=True) == rank.dequantized_bytes + rank.dequantized_copy_bytes
    for dtype, device in (("bfloat16", "cpu"), ("float32", "cuda")):
        for rank in planned(checkpoints[name], tp=2, dtype=dtype, device=device).ranks:
            assert rank.float_copy_bytes == rank.dequantized_copy_bytes == 0


def test_quantized_slices_at_tp_2_by_hand(checkpoints: dict[str, Path]) -> None:
    # 16 x 16 fp8 blocks, groups of 16: every projection splits in half on a boundary (q/k/v, gate/up by rows, o_proj
    # and down_proj by columns: 64 / 2, 32 / 2, 128 / 2 are multiples of 16), so each rank holds half of every
    # stored part it keeps (INT4's weight_shape, [2] int64, is not kept).
    fp8 = stored_bytes(checkpoints["llama-fp8"], is_quantized_part)
    assert [rank.quantized_bytes for rank in planned(checkpoints["llama-fp8"], tp=2).ranks] == [
        sum(fp8.values()) // 2
    ] * 2
    int4 = stored_bytes(checkpoints["llama-int4"], is_quantized_part)
    shapes = {name: size for name, size in int4.items() if name.endswith("weight_shape")}
    assert len(shapes) == 4 * 7 and set(shapes.values()) == {16}
    plan = planned(checkpoints["llama-int4"], tp=2)
    assert [rank.quantized_bytes for rank in plan.ranks] == [(sum(int4.values()) - sum(shapes.values())) // 2] * 2
    assert plan.cuts == ()


def test_a_split_inside_a_block_is_reported_and_both_ranks_hold_its_scales(checkpoints: dict[str, Path]) -> None:
    # q_proj is [64, 64] in 48 x 48 blocks (scales [2, 2]): tp 2 splits its rows at 32, inside block row 0, so
    # rank 0 holds scale row 0 and rank 1 both rows; o_proj splits its columns at 32 the same way.
    plan = planned(checkpoints["llama-fp8-cut"], tp=2)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert CutBlock(q_proj, rank=0, dim=0, start=0, end=32, cell=48) in plan.cuts
    assert CutBlock(q_proj, rank=1, dim=0, start=32, end=64, cell=48) in plan.cuts
    assert CutBlock("model.layers.0.self_attn.o_proj.weight", rank=1, dim=1, start=32, end=64, cell=48) in plan.cuts
    total = sum(stored_bytes(checkpoints["llama-fp8-cut"], is_quantized_part).values())
    assert sum(rank.quantized_bytes for rank in plan.ranks) > total  # the scales of cut blocks, on both ranks


def test_a_tp_that_cuts_blocks_is_refused_before_any_rank_starts_unless_dequantized(
    checkpoints: dict[str, Path],
) -> None:
    with pytest.raises(QuantizationError, match=CUT_DOWN_PROJ):
        check_tensor_parallel(checkpoints["llama-fp8-cut"], 2)
    check_tensor_parallel(checkpoints["llama-fp8-cut"], 2, dequantize=True)
    check_tensor_parallel(checkpoints["llama-fp8"], 2)


def test_no_tensor_data_is_read(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    source = checkpoints["llama-sharded-tied"]
    for kind in ("truncated", "garbage"):
        directory = shutil.copytree(source, tmp_path / kind)
        for path in directory.glob("*.safetensors"):
            content = path.read_bytes()
            header_end = 8 + struct.unpack("<Q", content[:8])[0]
            rest = b"" if kind == "truncated" else bytes(range(256)) * (len(content) // 256 + 1)
            path.write_bytes(content[:header_end] + rest[: len(content) - header_end])
        assert planned(directory, tp=2) == planned(source, tp=2)
    with pytest.raises(Exception):  # noqa: B017 - whatever reading the data raises: it is not there
        load_target(tmp_path / "truncated")


def test_a_target_that_fits_with_one_block_to_spare_and_one_that_is_short(
    checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    plan = planned(checkpoints["llama"], tp=2)
    rank = plan.ranks[0]  # the larger: vocab 330 leaves rank 1 no padding rows of its own
    exact = rank.weight_bytes(dequantize=False) + BLOCK_SIZE * rank.kv_token_bytes  # float32 on the CPU: with copies
    arguments = ["plan", "--target", str(checkpoints["llama"]), "--tp", "2", "--device", "cpu"]
    assert main([*arguments, "--gpu-memory-bytes", str(exact)]) == 0
    assert f"fits: {BLOCK_SIZE} tokens of KV on every rank, with the weights" in capsys.readouterr().out
    assert main([*arguments, "--gpu-memory-bytes", str(exact - 100)]) == 1
    assert "does not fit: rank 0 is short by 0.00 GiB (100 bytes) for its weights and one KV block" in (
        capsys.readouterr().out
    )
    assert main(arguments) == 0  # the machine's available memory, over the ranks
    assert "MemAvailable" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", "--target {target}: no such directory"),
        ("no-config", "config.json: not found in {target}"),
        ("bad-config", "config.json in {target}: not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        ("bad-index", "{target}/model.safetensors.index.json: no weight_map of tensor names to file names"),
        ("architecture", "architectures: 'NoSuchForCausalLM' is not a supported target"),
        ("tp", "tp 3 does not divide num_attention_heads 4"),
        ("tensor", "missing tensor model.layers.0.self_attn.q_proj.weight in {target}"),
    ],
)
def test_input_that_cannot_be_planned_exits_2_naming_it(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str, message: str
) -> None:
    target = tmp_path / "target"
    if change != "missing":
        shutil.copytree(checkpoints["llama"], target)
    if change == "no-config":
        (target / "config.json").unlink()
    if change == "bad-config":
        (target / "config.json").write_text("not JSON")
    if change == "bad-index":
        (target / "model.safetensors.index.json").write_text('{"metadata": {}}')
    if change == "architecture":
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchForCausalLM"]}))
    if change == "tensor":
        tensors = load_file(str(target / "model.safetensors"))
        del tensors["model.layers.0.self_attn.q_proj.weight"]
        save_file(tensors, str(target / "model.safetensors"))
    tp = "3" if change == "tp" else "1"
    assert main(["plan", "--target", str(target), "--tp", tp, "--device", "cpu", "--gpu-memory-bytes", "1G"]) == 2
    assert f"tandem plan: {message.format(target=target)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "part", "stored", "expected"),
    [
        ("llama-fp8", "weight", torch.float32, "F32, block-wise fp8 e4m3 (16x16 blocks) stores F8_E4M3"),
        ("llama-int4", "weight_packed", torch.int64, "I64, compressed-tensors pack-quantized int4"),
    ],
)
def test_a_quantized_part_in_another_dtype_is_refused_as_the_loader_refuses_it(
    checkpoints: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    part: str,
    stored: torch.dtype,
    expected: str,
) -> None:
    target = shutil.copytree(checkpoints[name], tmp_path / "target")
    tensors = load_file(str(target / "model.safetensors"))
    changed = f"model.layers.0.self_attn.q_proj.{part}"
    tensors[changed] = tensors[changed].to(stored)
    save_file(tensors, str(target / "model.safetensors"))
    assert main(["plan", "--target", str(target), "--device", "cpu", "--gpu-memory-bytes", "1G"]) == 2
    assert f"tandem plan: tensor {changed} in {target}: stored as {expected}" in capsys.readouterr().err
    with pytest.raises(QuantizationError, match=f"tensor {changed}: expected"):
        load_target(target)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """DeepSeek-V3 as released (671B parameters plus the 14B NextN layer), headers only: 8 bytes of data in all."""
    directory = tmp_path_factory.mktemp("deepseek-v3")
    config = deepseek_v3_config()
    (directory / "config.json").write_text(json.dumps(config))
    tensors = deepseek_v3_tensors(config)
    write_header_only(directory / "model.safetensors", tensors, data=b"not data")
    return directory, tensors


def test_deepseek_v3_plans_from_headers_alone(
    deepseek_v3: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, tensors = deepseek_v3
    target_bytes = sum(
        math.prod(shape) * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
        for name, (dtype, shape) in tensors.items()
        if not name.startswith("model.layers.61.")
    )
    token_bytes = 61 * (512 + 64) * 2  # one latent row per token and layer, bfloat16
    arguments = ["plan", "--target", str(directory), "--device", "cuda", "--gpu-memory-bytes", str(H200_BYTES)]
    assert main([*arguments, "--tp", "1"]) == 1
    out = capsys.readouterr().out
    assert "parameters read by the target: 671.03 billion" in out
    assert f"61 layers x 1 KV heads x 576 (one row) x 2 bytes = {token_bytes} bytes" in out
    assert f"weights as stored: {target_bytes / 2**30:.2f} GiB ({target_bytes} bytes) (planned)" in out
    shortfall = target_bytes + BLOCK_SIZE * token_bytes - H200_BYTES
    assert f"does not fit: rank 0 is short by {shortfall / 2**30:.2f} GiB ({shortfall} bytes)" in out
    # Eight H200s: it fits. By hand, a rank holds the replicated weights whole (norms, the latent down projections,
    # the routers) and an eighth of every other one: heads, units, experts' units (whole fp8 blocks: 8 divides every
    # split into blocks) and the vocabulary.
    assert main([*arguments, "--tp", "8"]) == 0
    out = capsys.readouterr().out
    replicated = ("norm", "q_a_proj", "kv_a_proj_with_mqa", "mlp.gate.")
    by_hand = sum(
        math.prod(shape) * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dtype] / (1 if any(r in name for r in replicated) else 8)
        for name, (dtype, shape) in tensors.items()
        if not name.startswith("model.layers.61.")
    )
    [rank_0] = re.findall(r"rank 0\n(?:.*\n){2}  weights as stored: [\d.]+ GiB \((\d+) bytes\)", out)
    assert abs(int(rank_0) / by_hand - 1) < 0.01, (rank_0, by_hand)
    assert out.splitlines()[-1].startswith("fits: ")
