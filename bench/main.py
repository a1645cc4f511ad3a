"""`tandem bench`: the split stack vs target-only vs colocated, on held-out prompts, greedy."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path

from bench.colocated import ColocatedEngine, ColocatedSettings
from bench.harness import Generate, GrpcGenerate, RunResult, run_prompts
from bench.prompts import held_out_prompts
from bench.report import write
from bench.settings import BenchSettings
from tandem.launcher import ServeProcess
from tandem.wire import orchestrator_pb2

WARMUP_PROMPT = "def main():\n"


async def _measure(generate: Generate, label: str, settings: BenchSettings, prompts: list[str]) -> list[RunResult]:
    warmup = orchestrator_pb2.GenerateRequest(prompt=WARMUP_PROMPT, max_new_tokens=8, ignore_eos=True)
    async for _ in generate(warmup):
        pass
    runs = []
    for concurrency in settings.concurrency:
        for _ in range(settings.repeats):
            for speculative in (True, False):
                run = await run_prompts(generate, prompts, concurrency, settings.max_new_tokens, speculative, label)
                runs.append(run)
    return runs


async def _split(settings: BenchSettings, prompts: list[str]) -> list[RunResult]:
    stack = None
    address = settings.address
    if address is None:
        stack = ServeProcess(
            [
                "--target", str(settings.target_dir),
                "--draft", str(settings.draft_dir),
                "--port", "0",
                "--speculative-num-steps", str(settings.num_steps),
                "--draft-replicas", str(settings.draft_replicas),
                "--dtype", settings.dtype,
            ]
        )  # fmt: skip
        address = stack.address
    client = GrpcGenerate(address)
    try:
        return await _measure(client, "split", settings, prompts)
    finally:
        await client.close()
        if stack is not None:
            stack.stop()


async def _colocated(settings: BenchSettings, prompts: list[str]) -> list[RunResult]:
    colocated = ColocatedSettings(
        settings.target_dir, settings.draft_dir, dtype=settings.dtype, num_steps=settings.num_steps
    )
    engine = ColocatedEngine(colocated)
    try:
        return await _measure(engine.generate, "colocated", settings, prompts)
    finally:
        await engine.close()


def run_benchmark(settings: BenchSettings) -> Path:
    prompts = held_out_prompts(settings.num_prompts)
    # One after the other, never overlapping: both setups get the whole machine.
    runs = asyncio.run(_split(settings, prompts))
    if settings.colocated:
        runs += asyncio.run(_colocated(settings, prompts))
    recorded = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}
    return write(settings.out_dir, runs, recorded)
