"""Decode speed on the CPU of a target that keeps quantized weights as stored, against `--dequantize`: the
DeepSeek-V3-shaped checkpoint of bench.quantized_memory (block-wise fp8 projections, or with --layout int4 Kimi-K2.5's
INT4 routed experts and bfloat16 rest; random values) loaded both ways in one process by the target's own loader and
runner (tandem.models.registry.load_target, target_server.runner.TargetRunner), one request decoding greedily, one
token a forward pass. The two runners alternate from pair to pair (which goes first alternates too), so that a slow
spell of a shared machine falls on both alike; each pair prints both rates, and the end the median ratio, its range,
how often the stored form was at least as fast, and whether both decoded the same tokens in every pair.

    python -m bench.quantized_decode [--layout fp8|int4] [--layers 6] [--pairs 10] [--tokens 32] [--threads 2]
                                     [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from bench.quantized_memory import write_checkpoint
from tandem.models.registry import load_target
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from target_server.runner import TargetRunner

PROMPT = list(range(3, 35))  # 32 tokens of the demo tokenizer's vocabulary
WAYS = ("as stored", "--dequantize")


def decode(runner: TargetRunner, request_id: str, tokens: int) -> tuple[float, list[int]]:
    """Prefills PROMPT, then decodes `tokens` tokens; -> (decoded tokens per second, the tokens)."""
    out = list(runner.prefill(request_id, PROMPT, SamplingParams(), ()).new_tokens)
    started = time.perf_counter()
    for _ in range(tokens):
        out += runner.verify(request_id).new_tokens
    elapsed = time.perf_counter() - started
    runner.release([request_id])
    return tokens / elapsed, out


def run(layers: int, pairs: int, tokens: int, layout: str) -> dict[str, Any]:
    cache = KVCacheSettings(num_blocks=64, block_size=16)
    with tempfile.TemporaryDirectory() as temporary:
        checkpoint = write_checkpoint(Path(temporary) / "checkpoint", layers, layout=layout)
        runners = {way: TargetRunner(load_target(checkpoint, dequantize=way != WAYS[0]), cache, 1024) for way in WAYS}
    for runner in runners.values():  # warm-up: the first products build oneDNN's kernels
        decode(runner, "warm-up", 4)
    rows: list[dict[str, Any]] = []
    ratios: list[float] = []
    for pair in range(pairs):
        order = WAYS if pair % 2 == 0 else WAYS[::-1]
        row = {way: decode(runners[way], f"pair-{pair}", tokens) for way in order}
        rates = {way: rate for way, (rate, _) in row.items()}
        ratios.append(rates[WAYS[0]] / rates[WAYS[1]])
        rows.append({"tok_s": rates, "ratio": ratios[-1], "same_tokens": row[WAYS[0]][1] == row[WAYS[1]][1]})
        print(f"pair {pair}: " + ", ".join(f"{way} {rate:.2f} tok/s" for way, rate in rates.items()), flush=True)
    return {
        "layout": layout,
        "layers": layers,
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "pairs": rows,
        "median_tok_s": {way: median(float(row["tok_s"][way]) for row in rows) for way in WAYS},
        "median_ratio": median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "stored_won": sum(ratio >= 1 for ratio in ratios),
        "same_tokens": all(row["same_tokens"] for row in rows),
    }


def markdown(result: dict[str, Any]) -> str:
    tok_s = result["median_tok_s"]
    low, high = result["ratio_range"]
    return (
        f"- {result['layout']} checkpoint, {result['layers']} layers, one request, {result['tokens']} tokens a run, "
        f"{result['threads']} threads, "
        f"{len(result['pairs'])} interleaved pairs\n"
        f"- median tok/s: as stored {tok_s[WAYS[0]]:.2f}, --dequantize {tok_s[WAYS[1]]:.2f}\n"
        f"- as stored / --dequantize: median {result['median_ratio']:.3f}x (range {low:.3f}-{high:.3f}), "
        f"as stored at least as fast in {result['stored_won']} of {len(result['pairs'])}\n"
        f"- same tokens both ways in every pair: {result['same_tokens']}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["fp8", "int4"], default="fp8", help="DeepSeek-V3's or Kimi-K2.5's")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers of the checkpoint")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=32, help="tokens decoded per run")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantized-decode"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(args.layers, args.pairs, args.tokens, args.layout)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{args.layout}-threads-{args.threads}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
