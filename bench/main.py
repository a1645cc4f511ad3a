"""`tandem bench`: the split stack vs target-only vs colocated vs transformers, on held-out prompts, greedy."""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.colocated import ColocatedEngine, ColocatedSettings
from bench.cpu import CpuMeter, spent
from bench.harness import Generate, GrpcGenerate, RoundSeconds, RunResult, run_prompts, scraped_round_seconds
from bench.huggingface import Method, TransformersBaseline, TransformersSettings
from bench.kinds import DraftKind, draft_kinds
from bench.prefix_report import write as write_prefix_report
from bench.prefix_workloads import run_workload
from bench.prompts import held_out_prompts
from bench.report import write, write_requests
from bench.settings import BenchSettings
from bench.structured import structured_prompts
from launch.devices import placement_of
from launch.model_dirs import shown
from launch.processes import ServeProcess
from launch.serve_settings import ServeSettings
from launch.stack_security import ServeSecurity
from orchestrator.settings import SchedulerSettings
from tandem import flags
from tandem.cpu_quota import applied_limit, default_intra_op_threads
from tandem.devices import DeviceRequest
from tandem.wire import orchestrator_pb2

WARMUP_PROMPT = "def main():\n"


@dataclass(frozen=True)
class Setup:
    label: str  # "split" (three processes, gRPC) or "colocated" (one process)
    kind: str  # the draft kind's name (bench/kinds.py), "" for the one configuration of --draft
    generate: Generate
    cpu: CpuMeter | None  # the processes that serve it; None: not measured (a stack someone else started)
    round_seconds: RoundSeconds | None = None  # where its rounds spend their time; None: not measured


async def _measure(
    setups: Sequence[Setup],
    baseline: TransformersBaseline | None,
    settings: BenchSettings,
    prompts: list[str],
    schemas: list[str],
) -> list[RunResult]:
    """Every configuration `repeats` times, interleaved run by run: per setup (split, colocated) each draft kind's
    speculative run and one target-only run (on the first kind's servers: the target is the same for all), each
    free and, with `schemas` (--structured), constrained, then transformers greedy and prompt-lookup (batch 1, in
    every repeat at every concurrency; free text). Odd repeats run the
    target-only run first: the first run of a setup comes after the others' runs, when its processes' caches and
    memory are cold, and that must not always fall on speculation.

    Runs never overlap, so each has the whole machine; interleaving makes the slow spells of a shared machine fall
    on every setup alike instead of on whichever ran during them.
    """
    warmup = orchestrator_pb2.GenerateRequest(prompt=WARMUP_PROMPT, max_new_tokens=8, ignore_eos=True)
    for setup in setups:
        async for _ in setup.generate(warmup):
            pass
    transformers = [(baseline, method) for method in Method] if baseline is not None else []
    for model, method in transformers:
        model.complete(WARMUP_PROMPT, 8, method)
    labels = list(dict.fromkeys(setup.label for setup in setups))
    variants: list[Sequence[str]] = [(), schemas] if schemas else [()]  # free text, then constrained
    tokens = settings.max_new_tokens
    runs = []
    for concurrency in settings.concurrency:
        for repeat in range(settings.repeats):
            for label in labels:
                of_label = [setup for setup in setups if setup.label == label]
                speculative = [(setup, True) for setup in of_label]
                target_only = (of_label[0], False)
                order = [target_only, *speculative] if repeat % 2 == 1 else [*speculative, target_only]
                for (setup, speculates), constrained in itertools.product(order, variants):
                    runs.append(await _run(setup, speculates, prompts, concurrency, tokens, constrained))
            for model, method in transformers:
                runs.append(model.run(prompts, settings.max_new_tokens, method))
    return runs


async def _run(
    setup: Setup, speculates: bool, prompts: list[str], concurrency: int, tokens: int, schemas: Sequence[str]
) -> RunResult:
    """One run of the prompt set on a setup, with the CPU time and round parts it cost where they are measured."""
    kind = setup.kind if speculates else ""
    before = setup.cpu.sample() if setup.cpu else {}
    rounds_before = setup.round_seconds() if setup.round_seconds else {}
    run = await run_prompts(setup.generate, prompts, concurrency, tokens, speculates, setup.label, kind, schemas)
    if setup.cpu is not None:
        run = replace(run, cpu_seconds=spent(before, setup.cpu.sample()))
    if setup.round_seconds is not None:
        run = replace(run, round_seconds=spent(rounds_before, setup.round_seconds()))
    return run


def _start_stack(settings: BenchSettings, kind: DraftKind, *extra: str) -> ServeProcess:
    """`tandem serve` of the benchmark's target with this kind's drafts, on free ports; `extra`: more flags."""
    scheduler = {
        "num_steps": kind.steps(settings),
        "adaptive_k": settings.adaptive_k,
        "draft_ahead": settings.draft_ahead,
    }
    return ServeProcess(
        [
            "--target", str(settings.target_dir),
            *kind.serve_arguments(settings),
            *flags.field_arguments(ServeSettings, port=0, target_threads=settings.target_threads),
            *flags.field_arguments(ServeSecurity, admin_port=0),
            *flags.field_arguments(SchedulerSettings, **scheduler),
            *flags.field_arguments(DeviceRequest, dtype=settings.dtype),
            *extra,
        ]
    )  # fmt: skip


def _start_stacks(settings: BenchSettings, kinds: Sequence[DraftKind]) -> list[ServeProcess]:
    """A stack for each kind, in their order, all started at once: each waits only for its own services, and none
    serves a request before every one is up. If one does not start, those that did are stopped."""
    with ThreadPoolExecutor(max(1, len(kinds))) as pool:
        starting = [pool.submit(_start_stack, settings, kind) for kind in kinds]
    started = [future.result() for future in starting if future.exception() is None]
    failed = [error for future in starting if (error := future.exception()) is not None]
    if failed:
        for stack in started:
            stack.stop()
        raise failed[0]
    return started


def _colocated(settings: BenchSettings, kind: DraftKind) -> ColocatedEngine:
    return ColocatedEngine(
        ColocatedSettings(
            settings.target_dir,
            kind.draft_dir,
            ngram=kind.ngram,
            hybrid=kind.hybrid,
            placement=placement_of(DeviceRequest(dtype=settings.dtype)),  # as the started stack resolves it
            num_steps=kind.steps(settings),
            tree=kind.tree,
            adaptive_k=settings.adaptive_k,
        )
    )


async def _benchmark(
    settings: BenchSettings, kinds: Sequence[DraftKind], prompts: list[str], schemas: list[str]
) -> list[RunResult]:
    stacks: list[ServeProcess] = []
    clients: list[GrpcGenerate] = []
    engines: list[ColocatedEngine] = []
    # The colocated engine and transformers compute on this thread with the target service's thread count.
    torch.set_num_threads(settings.target_threads or default_intra_op_threads(applied_limit()))
    try:
        if settings.address is None:
            stacks += _start_stacks(settings, kinds)
        for index in range(len(kinds)):
            clients.append(GrpcGenerate(settings.address or stacks[index].address))
        # A stack of our own is measured process by process; a running one (--address) is not ours to look into.
        meters: list[CpuMeter | None] = [CpuMeter(stack.process.pid, tree=True) for stack in stacks]
        if not meters:
            meters = [None] * len(clients)
        observers: list[RoundSeconds | None] = [scraped_round_seconds(f"{stack.http_url}/metrics") for stack in stacks]
        if not observers:
            observers = [None] * len(clients)
        setups = [
            Setup("split", kind.name, client, meter, observer)
            for kind, client, meter, observer in zip(kinds, clients, meters, observers, strict=True)
        ]
        if settings.colocated:
            own = CpuMeter(os.getpid(), tree=False)
            for kind in kinds:
                engines.append(_colocated(settings, kind))
                setups.append(Setup("colocated", kind.name, engines[-1].generate, own, engines[-1].round_seconds))
        baseline = None
        if settings.transformers:
            baseline = TransformersBaseline(
                TransformersSettings(settings.target_dir, settings.dtype, settings.prompt_lookup_num_tokens)
            )
        return await _measure(setups, baseline, settings, prompts, schemas)
    finally:
        for client in clients:
            await client.close()
        for engine in engines:
            await engine.close()
        for stack in stacks:
            stack.stop()


def _recorded(value: Any) -> Any:
    """Settings as JSON values: paths as `shown` names them, nested dataclasses (already dicts from asdict) element
    by element."""
    if isinstance(value, Path):
        return shown(value)
    if isinstance(value, dict):
        return {key: _recorded(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_recorded(item) for item in value]
    return value


def _prefix_benchmark(settings: BenchSettings) -> Path:
    """The shared-prefix or multi-turn workload on two stacks of the draft's kind, prefix caching on and off."""
    (kind,) = draft_kinds(settings)
    stacks = {
        "cache": _start_stack(settings, kind),
        "no cache": _start_stack(settings, kind, "--no-enable-prefix-caching"),
    }
    try:
        runs = []
        for concurrency in settings.concurrency if settings.prefix.workload == "shared-prefix" else (0,):
            addresses = {name: stack.address for name, stack in stacks.items()}
            metrics = {name: f"{stack.http_url}/metrics" for name, stack in stacks.items()}
            runs += asyncio.run(run_workload(settings, addresses, metrics, concurrency))
    finally:
        for stack in stacks.values():
            stack.stop()
    draft = settings.draft_dir.name if settings.draft_dir is not None else "ngram"
    out = settings.out_dir / f"prefix-{settings.prefix.workload}-{draft}"
    return write_prefix_report(out, runs, _recorded(asdict(settings)), shlex.join(["tandem", *sys.argv[1:]]))


def run_benchmark(settings: BenchSettings) -> Path:
    if settings.prefix.workload != "held-out":
        return _prefix_benchmark(settings)
    kinds = draft_kinds(settings)
    if settings.structured:
        prompts, schemas = structured_prompts(settings.num_prompts)
    else:
        prompts, schemas = held_out_prompts(settings.num_prompts), []
    runs = asyncio.run(_benchmark(settings, kinds, prompts, schemas))
    recorded = _recorded(asdict(settings))
    if settings.kinds:
        recorded["draft_kinds"] = {kind.name: kind.describe() for kind in kinds}
    if settings.save_requests is not None:
        write_requests(settings.save_requests, runs, recorded)
    return write(settings.out_dir, runs, recorded)
