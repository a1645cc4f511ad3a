"""`python -m bench.gpu`: the target side of speculative decoding on a GPU, for a Llama-3.1-8B-shaped target.

The target is built in GPU memory with random weights from Llama-3.1-8B's config (no download, no checkpoint), so
its tokens mean nothing and a draft model cannot predict them; acceptance is therefore fixed by hand. Per batch size
it times, on TargetRunner steps:
    target-only  one verification without drafts per request per round: 1 token a round;
    speculative  one verification of k drafts per request per round, for k = 1..--max-drafts; with an acceptance
                 length L (1..k+1) a round commits L tokens, so tok/s at L is batch * L / round time. Draft compute
                 and the wire are not included: this measures what the target can deliver at a given acceptance.
Results go to --out as JSON and Markdown. On a machine without CUDA it stops with one line and exit code 2.
Its first run, on an H200, is in bench/results/gpu/2026-12-04-h200 (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.models.registry import TargetModel, target_architecture
from tandem.parallel.group import SINGLE_PROCESS
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.items import StepItem
from target_server.runner import TargetRunner

# Llama-3.1-8B's config.json, the fields Tandem reads.
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def random_target(device: torch.device, dtype: torch.dtype, seed: int) -> TargetModel:
    """The 8B-shaped model with weights drawn from N(0, 0.02), norms at 1, built straight on `device` (rotary
    frequencies are computed from the config, not loaded: tandem.layers.rotary)."""
    with torch.device("meta"):
        model = target_architecture("LlamaForCausalLM").build(LLAMA_3_1_8B, SINGLE_PROCESS)
    assert isinstance(model, torch.nn.Module)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)
    model.eval()
    return model


def round_seconds(runner: TargetRunner, batch: int, drafts: int, rounds: int, prompt: int) -> float:
    """Median seconds of a round: every one of `batch` requests verifies `drafts` tokens in one step."""
    ids = [f"r{index}" for index in range(batch)]
    for request_id in ids:
        runner.prefill(request_id, list(range(1000, 1000 + prompt)), SamplingParams())
    times = []
    for _ in range(rounds + 2):  # two warm-up rounds
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.step([StepItem(request_id, 1, DraftTree.chain([7] * drafts)) for request_id in ids])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    runner.release(ids)
    return sorted(times[2:])[len(times[2:]) // 2]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--attention-backend", choices=("torch", "flashinfer"), help="default: the device's")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replay the rounds from CUDA graphs (tandem.layers.cuda_graphs; needs the flashinfer backend)",
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-drafts", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: needs a CUDA GPU; torch.cuda.is_available() is False on this machine", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    model = random_target(device, getattr(torch, args.dtype), seed=0)
    cache = KVCacheSettings(
        memory_bytes=16 * 2**30, attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs
    )
    runner = TargetRunner(model, cache, max_context=8192)
    rows = []
    for batch in args.batch:
        target_only = round_seconds(runner, batch, 0, args.rounds, args.prompt_tokens)
        row: dict[str, Any] = {"batch": batch, "target_only_tok_s": batch / target_only, "speculative": {}}
        for drafts in range(1, args.max_drafts + 1):
            seconds = round_seconds(runner, batch, drafts, args.rounds, args.prompt_tokens)
            per_length = {length: batch * length / seconds for length in range(1, drafts + 2)}
            row["speculative"][drafts] = {"round_ms": 1000 * seconds, "tok_s_by_acceptance_length": per_length}
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    summary = {"model": "Llama-3.1-8B shape, random weights", "dtype": args.dtype, "machine": machine, "rows": rows}
    summary["attention_backend"] = runner.cache.backend.name
    summary["cuda_graphs"] = args.cuda_graphs
    (args.out / "latest.json").write_text(json.dumps(summary, indent=2))
    lines = ["| batch | drafts k | round ms | target-only tok/s | tok/s at L = 1 .. k + 1 |", "|---|---|---|---|---|"]
    for row in rows:
        for drafts, result in row["speculative"].items():
            rates = " ".join(f"{rate:.0f}" for rate in result["tok_s_by_acceptance_length"].values())
            cells = [row["batch"], drafts, f"{result['round_ms']:.2f}", f"{row['target_only_tok_s']:.0f}", rates]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    (args.out / "latest.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
