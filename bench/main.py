"""`tandem bench`: the split stack vs target-only vs colocated, on held-out prompts, greedy."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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


async def _measure(
    setups: Sequence[tuple[str, Generate]], settings: BenchSettings, prompts: list[str]
) -> list[RunResult]:
    """Every configuration `repeats` times, interleaved run by run: setup after setup, speculative then target-only.

    Runs never overlap, so each has the whole machine; interleaving makes the slow spells of a shared machine fall
    on both setups alike instead of on whichever ran during them.
    """
    warmup = orchestrator_pb2.GenerateRequest(prompt=WARMUP_PROMPT, max_new_tokens=8, ignore_eos=True)
    for _, generate in setups:
        async for _ in generate(warmup):
            pass
    runs = []
    for concurrency in settings.concurrency:
        for _ in range(settings.repeats):
            for label, generate in setups:
                for speculative in (True, False):
                    run = await run_prompts(generate, prompts, concurrency, settings.max_new_tokens, speculative, label)
                    runs.append(run)
    return runs


async def _benchmark(settings: BenchSettings, prompts: list[str]) -> list[RunResult]:
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
                "--target-threads", str(settings.target_threads),
                "--draft-threads", str(settings.draft_threads),
            ]
        )  # fmt: skip
        address = stack.address
    client = GrpcGenerate(address)
    engine = None
    try:
        setups: list[tuple[str, Generate]] = [("split", client)]
        if settings.colocated:
            colocated = ColocatedSettings(
                settings.target_dir, settings.draft_dir, dtype=settings.dtype, num_steps=settings.num_steps
            )
            engine = ColocatedEngine(colocated)
            setups.append(("colocated", engine.generate))
        return await _measure(setups, settings, prompts)
    finally:
        await client.close()
        if engine is not None:
            await engine.close()
        if stack is not None:
            stack.stop()


def run_benchmark(settings: BenchSettings) -> Path:
    prompts = held_out_prompts(settings.num_prompts)
    runs = asyncio.run(_benchmark(settings, prompts))
    recorded = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}
    return write(settings.out_dir, runs, recorded)
