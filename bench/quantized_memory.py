"""Resident memory of a target that keeps fp8 weights as stored, against `--dequantize`: a DeepSeek-V3-shaped
checkpoint of a few hundred MB in the release's layout (bench.deepseek_layout: every projection block-wise fp8 with
float32 scales, the rest bfloat16; random values) is served by `tandem target` (a pool of 16 KV blocks) each way. Once
it serves, its resident size over an idle interpreter that imported torch is set beside what `tandem plan` counts for
that way (weights as held, with oneDNN's copies of float linear weights on the CPU). Two sizes show what the process
holds besides its weights (gRPC, tokenizer, a small KV pool): the same tens of MiB at each. The stored form's target
also holds the fused CPU products (Numba and its LLVM, tandem.layers.cpu_products), measured apart in an interpreter
that only readies them.

    python -m bench.quantized_memory [--layers 6 10] [--out bench/results/quantized-memory]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.deepseek_layout import deepseek_v3_config, deepseek_v3_tensors, int4_experts_config, int4_experts_tensors
from bench.fault_stack import Service, free_port, tandem
from tandem.models.config import read_hf_config
from tandem.models.memory_plan import plan_memory
from tandem.settings import DEMO_TARGET
from tandem.weights.headers import checkpoint_headers

MIB = 1 << 20
# DeepSeek-V3's shape at a smaller size: the first layer dense, then 16 routed experts of 512 units; 4096 tokens.
SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 512,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 768,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "vocab_size": 4096,  # the demo's tokenizer
    "max_position_embeddings": 4096,
}
DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
INT4_GROUP = 32  # Kimi-K2.5's
RESIDENT = "import re; print(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read())[1])"
IDLE = "import torch; " + RESIDENT
# The same with the fused CPU products ready (Numba and its LLVM): what the stored form's target adds at load.
KERNELS = "import torch; from tandem.layers import cpu_products; cpu_products.warm(); " + RESIDENT


def write_checkpoint(directory: Path, layers: int, seed: int = 0, layout: str = "fp8") -> Path:
    """The checkpoint, with the demo's tokenizer, in DeepSeek-V3's layout (`layout` "fp8") or Kimi-K2.5's ("int4":
    routed experts INT4 in groups of 32, the rest bfloat16): fp8 codes and INT4 words drawn uniformly (but fp8's NaN
    codes), fp8 scales near 1e-3, INT4 scales near 1e-2."""
    generator = torch.Generator().manual_seed(seed)
    config = deepseek_v3_config() | SHAPE | {"num_hidden_layers": layers, "bos_token_id": 1, "eos_token_id": 2}
    config.pop("rope_scaling")
    layout_tensors = float_shapes = deepseek_v3_tensors(config)
    if layout == "int4":
        config["quantization_config"] = int4_experts_config(INT4_GROUP)
        layout_tensors = int4_experts_tensors(float_shapes, INT4_GROUP)
    tensors = {}
    for name, (dtype, shape) in layout_tensors.items():
        if dtype == "F8_E4M3":
            codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # e4m3fn's NaN codes
            tensors[name] = codes.view(torch.float8_e4m3fn)
        elif name.endswith("weight_scale_inv"):
            tensors[name] = torch.rand(shape, generator=generator) * 1e-3 + 5e-4
        elif name.endswith("weight_packed"):
            tensors[name] = torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, generator=generator)
        elif name.endswith("weight_scale"):
            tensors[name] = (torch.rand(shape, generator=generator) * 1e-2 + 5e-3).to(torch.bfloat16)
        elif name.endswith("weight_shape"):
            tensors[name] = torch.tensor(float_shapes[name.removesuffix("_shape")][1], dtype=torch.int64)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(DTYPES[dtype])
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, directory / name)
    return directory


def resident(service: Service) -> dict[str, int]:
    assert service.process is not None
    status = Path(f"/proc/{service.process.pid}/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status)[1]) * 1024 for key in ("VmRSS", "VmHWM")}  # type: ignore[index]


def measure(checkpoint: Path, dequantize: bool, workdir: Path) -> dict[str, int]:
    flags = ["--dequantize"] if dequantize else []
    command = tandem("target", "--model", str(checkpoint), "--kv-blocks", "16", "--threads", "1", *flags)
    service = Service("target", command, free_port())
    service.start(workdir)
    try:
        return resident(service)
    finally:
        service.stop()


def run(layers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as temporary:
        workdir = Path(temporary)
        checkpoint = write_checkpoint(workdir / "deepseek-fp8", layers)
        stored = sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))
        plan = plan_memory(read_hf_config(checkpoint), checkpoint_headers(checkpoint), 1, "float32", "cpu", "bench")
        idle = resident_of(IDLE)
        kernels = resident_of(KERNELS) - idle
        rank = plan.ranks[0]
        ways = {
            "as stored": (False, rank.quantized_bytes + rank.float_bytes + rank.float_copy_bytes),
            "--dequantize": (True, rank.dequantized_bytes + rank.dequantized_copy_bytes),
        }
        rows = {}
        for name, (dequantize, planned) in ways.items():
            memory = measure(checkpoint, dequantize, workdir)
            over_idle = memory["VmRSS"] - idle
            rows[name] = {"planned_bytes": planned, "rss_over_idle_bytes": over_idle, "ratio": over_idle / planned}
            rows[name] |= {"rss_bytes": memory["VmRSS"], "hwm_bytes": memory["VmHWM"]}
            rows[name]["ratio_without_kernels"] = (over_idle - (0 if dequantize else kernels)) / planned
    return {
        "layers": layers,
        "checkpoint_bytes": stored,
        "idle_rss_bytes": idle,
        "kernels_bytes": kernels,
        "ways": rows,
    }


def resident_of(program: str) -> int:
    """The resident bytes of a Python running `program`, which prints its VmRSS in kB."""
    found = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    return int(found) * 1024


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        f"- idle interpreter with torch: {results[0]['idle_rss_bytes'] / MIB:.0f} MiB resident; the fused CPU "
        f"products ready (Numba, LLVM) add {results[0]['kernels_bytes'] / MIB:.0f} MiB, which the stored form's "
        "target loads",
        "",
        "| layers | checkpoint | way | planned weights (tandem plan) | resident over idle | ratio "
        "| ratio less the kernels' | peak resident |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for name, row in result["ways"].items():
            lines.append(
                f"| {result['layers']} | {result['checkpoint_bytes'] / MIB:.0f} MiB | {name} "
                f"| {row['planned_bytes'] / MIB:.0f} MiB | {row['rss_over_idle_bytes'] / MIB:.0f} MiB "
                f"| {row['ratio']:.2f} | {row['ratio_without_kernels']:.2f} | {row['hwm_bytes'] / MIB:.0f} MiB |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 10], help="checkpoint sizes: decoder layers")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantized-memory"))
    args = parser.parse_args()
    results = [run(layers) for layers in args.layers]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "latest.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
