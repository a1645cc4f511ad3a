"""The demo (scripts/quickstart.sh): serve the bundled pair, stream one completion, then measure held-out prompts
with speculation, without it, and with transformers' greedy `generate` on the same model, interleaved.

    python -m bench.quickstart [--prompts 6] [--max-new-tokens 64]

Every mode is warmed first (a fresh process's first forward passes are slow). Then each prompt runs in all three
modes, in an order that rotates from prompt to prompt, so that a slow spell of a shared machine does not fall on one
mode. It prints each mode's median tokens per second, the median speedup with its range over the prompts, and
whether the three greedy completions were the same tokens (speculation must not change the output).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from statistics import median
from typing import TypeVar

from bench.harness import GrpcGenerate
from bench.huggingface import Method, TransformersBaseline, TransformersSettings
from bench.prompts import held_out_prompts
from launch.processes import ServeProcess
from tandem.settings import DEMO_TARGET
from tandem.wire import orchestrator_pb2

STREAMED_PROMPT = (
    'import json\n\n\ndef load_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n'
)
STREAMED_TOKENS = 96
WARMUP_PROMPT = "def main():\n"
SPECULATIVE, TARGET_ONLY, TRANSFORMERS = "speculative", "target only", "transformers greedy"
MODES = (SPECULATIVE, TARGET_ONLY, TRANSFORMERS)
Completion = tuple[tuple[int, ...], float]  # token ids, seconds
T = TypeVar("T")


class Demo:
    def __init__(self, stack: ServeProcess, baseline: TransformersBaseline) -> None:
        self.generate = GrpcGenerate(stack.address)
        self.baseline = baseline

    async def tandem(self, prompt: str, max_new_tokens: int, speculate: bool, echo: bool = False) -> Completion:
        """A greedy completion from the stack, streamed to the terminal with `echo`."""
        request = orchestrator_pb2.GenerateRequest(
            prompt=prompt, max_new_tokens=max_new_tokens, ignore_eos=True, disable_speculation=not speculate
        )
        started = time.perf_counter()
        tokens: list[int] = []
        async for message in self.generate(request):
            tokens.extend(message.token_ids)
            if echo:
                print(message.text, end="", flush=True)
            if message.finish_reason and echo:
                stats = message.stats
                print(
                    f"\n[{stats.completion_tokens} tokens in {stats.rounds} rounds, "
                    f"{stats.accepted_tokens} of {stats.draft_tokens} draft tokens accepted]"
                )
        return tuple(tokens), time.perf_counter() - started

    def transformers(self, prompt: str, max_new_tokens: int) -> Completion:
        started = time.perf_counter()
        tokens = self.baseline.complete(prompt, max_new_tokens, Method.GREEDY)
        return tokens, time.perf_counter() - started

    async def run(self, mode: str, prompt: str, max_new_tokens: int) -> Completion:
        if mode == TRANSFORMERS:
            return self.transformers(prompt, max_new_tokens)
        return await self.tandem(prompt, max_new_tokens, speculate=mode == SPECULATIVE)


async def measure(demo: Demo, prompts: Sequence[str], max_new_tokens: int) -> tuple[dict[str, list[float]], bool]:
    """Tokens per second of every prompt in every mode, and whether the three modes' tokens were the same."""
    for mode in MODES:
        await demo.run(mode, WARMUP_PROMPT, 8)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    same = True
    for index, prompt in enumerate(prompts):
        order = MODES[index % 3 :] + MODES[: index % 3]
        outputs = {}
        for mode in order:
            tokens, seconds = await demo.run(mode, prompt, max_new_tokens)
            outputs[mode] = tokens
            rates[mode].append(len(tokens) / seconds)
        same = same and len(set(outputs.values())) == 1
        line = ", ".join(f"{mode} {rates[mode][-1]:.1f}" for mode in MODES)
        print(f"prompt {index + 1}/{len(prompts)}: {line} tok/s", flush=True)
    return rates, same


def _ratios(numerator: list[float], denominator: list[float]) -> str:
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return f"{median(ratios):.2f}x (range {min(ratios):.2f}x-{max(ratios):.2f}x)"


def summary(rates: dict[str, list[float]], same: bool) -> list[str]:
    lines = [f"{mode:<20} median {median(rates[mode]):6.1f} tok/s" for mode in MODES]
    speculative = rates[SPECULATIVE]
    lines.append(f"speculation over target only: {_ratios(speculative, rates[TARGET_ONLY])}")
    lines.append(f"speculation over transformers greedy: {_ratios(speculative, rates[TRANSFORMERS])}")
    lines.append(f"greedy tokens identical in the three modes: {'yes' if same else 'NO'}")
    return lines


def _step(what: str, call: Callable[[], T]) -> T:
    print(f"{what} ...", flush=True)
    started = time.perf_counter()
    result = call()
    print(f"{what}: {time.perf_counter() - started:.1f} s", flush=True)
    return result


async def _main(stack: ServeProcess, baseline: TransformersBaseline, prompts: list[str], tokens: int) -> bool:
    demo = Demo(stack, baseline)
    try:
        print("--- a completion, streamed (speculative: the demo's DFlash drafter drafts up to 7 tokens a round) ---")
        await demo.tandem(STREAMED_PROMPT, STREAMED_TOKENS, speculate=True, echo=True)
        print(f"--- {len(prompts)} held-out prompts x {tokens} tokens in each mode, interleaved ---")
        rates, same = await measure(demo, prompts, tokens)
    finally:
        await demo.generate.close()
    print("---")
    print("\n".join(summary(rates, same)))
    return same


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quickstart", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts to measure (default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per completion (default 64)")
    args = parser.parse_args(argv)
    prompts = held_out_prompts(args.prompts)
    # The demo's fastest drafter at one request (docs/benchmarks.md, "Block drafters beside EAGLE3").
    serve = ["--port", "0", "--admin-port", "0", "--draft", "demo:dflash"]
    stack = _step(
        "starting tandem serve (the demo pair: target, draft and orchestrator processes)", lambda: ServeProcess(serve)
    )
    try:
        print(next(line for line in stack.log if "tandem ready" in line).strip())
        settings = TransformersSettings(DEMO_TARGET, "float32", prompt_lookup_num_tokens=10)
        baseline = _step("loading the target in transformers", lambda: TransformersBaseline(settings))
        same = asyncio.run(_main(stack, baseline, prompts, args.max_new_tokens))
    finally:
        stack.stop()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
