"""An interleaved A/B of two code trees (CONTRIBUTING.md: a latency feature stays only when it beats the noise).

    python -m bench.ab --a DIR [--a-module launch.cli] --b DIR [--draft D] [--pairs 10] [--concurrency 1 8]
                       [--structured] [--penalties] [--out FILE]

Both trees serve the demo pair with `tandem serve` at once (each its own three processes, started from its own
source with PYTHONPATH), and the held-out prompts run greedy against one, then the other, the order alternating from
pair to pair, so that a slow spell of a shared machine falls on both sides alike. It prints and writes (JSON) each
pair's tok/s and mean acceptance length, the medians, the B/A ratio's median and range, how often B won, and whether
the two trees' completions were the same tokens in every pair. With --structured every request carries its prompt's
JSON schema (bench/structured.py); with --penalties every request carries PENALTIES.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from bench.harness import GrpcGenerate, RunResult, run_prompts
from bench.prompts import held_out_prompts
from bench.structured import structured_prompts
from launch.processes import ServeProcess

# What --penalties sends: OpenAI's presence and frequency penalties as its docs suggest against repetition.
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5}


def _stack(tree: Path, module: str, draft: str | None) -> ServeProcess:
    """`tandem serve` of the demo pair (with `draft`, else the default head) from `tree`'s source (run from a
    directory outside both trees: `python -m` puts the working directory first on the path)."""
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    drafting = ["--draft", draft] if draft else []
    return ServeProcess(["--port", "0", "--admin-port", "0", *drafting], module=module, env=environment)


async def _pairs(
    addresses: dict[str, str], prompts: list[str], schemas: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    clients = {side: GrpcGenerate(address) for side, address in addresses.items()}
    pairs: dict[str, list[dict[str, Any]]] = {}
    same = True
    try:
        for concurrency in args.concurrency:
            pairs[f"c{concurrency}"] = []
            for number in range(args.pairs):
                order = ["a", "b"] if number % 2 == 0 else ["b", "a"]
                runs: dict[str, RunResult] = {}
                for side in order:
                    label = f"{side} pair {number + 1}"
                    runs[side] = await run_prompts(
                        clients[side], prompts, concurrency, args.max_new_tokens, True, label, schemas=schemas,
                        options=PENALTIES if args.penalties else {},
                    )  # fmt: skip
                same = same and runs["a"].outputs() == runs["b"].outputs()
                pair = {
                    side: [round(run.tokens_per_second, 1), round(run.mean_acceptance_length, 2)]
                    for side, run in runs.items()
                }
                pairs[f"c{concurrency}"].append({"order": order, **pair})
    finally:
        for client in clients.values():
            await client.close()
    return {"pairs": pairs, "identical_outputs": same}


def summarise(pairs: list[dict[str, Any]]) -> dict[str, float]:
    ratios = [pair["b"][0] / pair["a"][0] for pair in pairs]
    return {
        "a_median": median(pair["a"][0] for pair in pairs),
        "b_median": median(pair["b"][0] for pair in pairs),
        "ratio_median": round(median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "b_wins": sum(ratio > 1 for ratio in ratios),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    for side in ("a", "b"):
        parser.add_argument(f"--{side}", type=Path, required=True, help=f"source tree {side.upper()}")
        parser.add_argument(f"--{side}-module", default="launch.cli", help="its CLI module (default launch.cli)")
    parser.add_argument("--draft", help="both stacks' --draft (e.g. demo:dflash); default: the demo head")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--structured", action="store_true", help="each request constrained by a JSON schema")
    parser.add_argument("--penalties", action="store_true", help="each request with presence and frequency penalties")
    parser.add_argument("--out", type=Path, help="write the pairs and summary here (JSON)")
    args = parser.parse_args(argv)
    prompts, schemas = structured_prompts(args.prompts) if args.structured else (held_out_prompts(args.prompts), [])
    stacks = {
        side: _stack(getattr(args, side).resolve(), getattr(args, f"{side}_module"), args.draft) for side in ("a", "b")
    }
    try:
        addresses = {side: stack.address for side, stack in stacks.items()}
        result = asyncio.run(_pairs(addresses, prompts, schemas, args))
    finally:
        for stack in stacks.values():
            stack.stop()
    result["summary"] = {name: summarise(pairs) for name, pairs in result["pairs"].items()}
    kind = "JSON-schema" if schemas else "held-out"
    with_penalties = f", {PENALTIES}" if args.penalties else ""
    result["what"] = f"A = {args.a}, B = {args.b}; {len(prompts)} {kind} prompts x {args.max_new_tokens} tokens"
    result["what"] += with_penalties
    for name, summary in result["summary"].items():
        print(f"{name}: {json.dumps(summary)}")
    print(f"identical outputs in every pair: {result['identical_outputs']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
