"""`tandem bench`: the split stack vs target-only vs colocated vs transformers, on held-out prompts, greedy."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from bench.colocated import ColocatedEngine, ColocatedSettings
from bench.harness import Generate, GrpcGenerate, RunResult, run_prompts
from bench.huggingface import Method, TransformersBaseline, TransformersSettings
from bench.prompts import held_out_prompts
from bench.report import write, write_requests
from bench.settings import BenchSettings
from tandem.launcher import ServeProcess, ngram_arguments, tree_arguments
from tandem.wire import orchestrator_pb2

WARMUP_PROMPT = "def main():\n"


async def _measure(
    setups: Sequence[tuple[str, Generate]],
    baseline: TransformersBaseline | None,
    settings: BenchSettings,
    prompts: list[str],
) -> list[RunResult]:
    """Every configuration `repeats` times, interleaved run by run: setup after setup, speculative then target-only,
    then transformers greedy and prompt-lookup (batch 1, in every repeat at every concurrency).

    Runs never overlap, so each has the whole machine; interleaving makes the slow spells of a shared machine fall
    on every setup alike instead of on whichever ran during them.
    """
    warmup = orchestrator_pb2.GenerateRequest(prompt=WARMUP_PROMPT, max_new_tokens=8, ignore_eos=True)
    for _, generate in setups:
        async for _ in generate(warmup):
            pass
    transformers = [(baseline, method) for method in Method] if baseline is not None else []
    for model, method in transformers:
        model.complete(WARMUP_PROMPT, 8, method)
    runs = []
    for concurrency in settings.concurrency:
        for _ in range(settings.repeats):
            for label, generate in setups:
                for speculative in (True, False):
                    run = await run_prompts(generate, prompts, concurrency, settings.max_new_tokens, speculative, label)
                    runs.append(run)
            for model, method in transformers:
                runs.append(model.run(prompts, settings.max_new_tokens, method))
    return runs


def _draft_arguments(settings: BenchSettings) -> list[str]:
    """`tandem serve`'s draft options: ngram (no draft process), or a draft model with its replicas and threads."""
    if settings.ngram is not None:
        return ngram_arguments(settings.ngram)
    assert settings.draft_dir is not None  # BenchSettings has a draft directory or ngram
    return [
        "--draft", str(settings.draft_dir.absolute()),  # absolute: a directory named ngram is not --draft ngram
        "--draft-replicas", str(settings.draft_replicas),
        "--draft-threads", str(settings.draft_threads),
    ]  # fmt: skip


async def _benchmark(settings: BenchSettings, prompts: list[str]) -> list[RunResult]:
    stack = None
    address = settings.address
    if address is None:
        stack = ServeProcess(
            [
                "--target", str(settings.target_dir),
                *_draft_arguments(settings),
                "--port", "0",
                "--admin-port", "0",
                "--speculative-num-steps", str(settings.num_steps),
                *tree_arguments(settings.tree),
                "--adaptive-k" if settings.adaptive_k else "--no-adaptive-k",
                "--dtype", settings.dtype,
                "--target-threads", str(settings.target_threads),
            ]
        )  # fmt: skip
        address = stack.address
    client = GrpcGenerate(address)
    engine = None
    if settings.target_threads:
        # The colocated engine and transformers compute on this thread with the target service's thread count.
        torch.set_num_threads(settings.target_threads)
    try:
        setups: list[tuple[str, Generate]] = [("split", client)]
        if settings.colocated:
            colocated = ColocatedSettings(
                settings.target_dir,
                settings.draft_dir,
                ngram=settings.ngram,
                dtype=settings.dtype,
                num_steps=settings.num_steps,
                tree=settings.tree,
                adaptive_k=settings.adaptive_k,
            )
            engine = ColocatedEngine(colocated)
            setups.append(("colocated", engine.generate))
        baseline = None
        if settings.transformers:
            baseline = TransformersBaseline(
                TransformersSettings(settings.target_dir, settings.dtype, settings.prompt_lookup_num_tokens)
            )
        return await _measure(setups, baseline, settings, prompts)
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
    if settings.save_requests is not None:
        write_requests(settings.save_requests, runs, recorded)
    return write(settings.out_dir, runs, recorded)
