"""`tandem bench-load`: many concurrent Generate streams against a `tandem serve` whose KV pool is too small for them.

It starts the stack on loopback (as `tandem bench` does), draws every stream's prompt (a window of held-out code,
as token ids) and token budget, opens all the streams at once over one gRPC channel and waits for them under a hard
timeout, sampling the resident memory of every process of the stack meanwhile (bench.memory). Then it asks the
target and every draft replica for their free KV blocks, which must come back to the pool's size, stops the stack
and writes the summary (bench.load_report).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from tqdm import tqdm

from bench.load_report import KVState, LoadRun, StreamResult, write
from bench.load_settings import LoadSettings
from bench.memory import MemorySampler, command_option
from bench.prompts import held_out_prompts
from launch.processes import ServeProcess
from orchestrator.settings import SchedulerSettings
from tandem.grpc_util import channel_options
from tandem.wire import (
    draft_pb2,
    draft_pb2_grpc,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

# Releases reach target and drafts just after each stream's last message: how long their free blocks may take to
# come back to the pool's size before the report records them as they are.
KV_SETTLE_S = 30.0
PREEMPTION_LINE = re.compile(r"KV pool full: preempting (\d+) requests")


class LoadTimeout(RuntimeError):
    """The streams did not all finish within the settings' timeout."""


@dataclass(frozen=True)
class Stream:
    index: int
    input_ids: tuple[int, ...]
    max_new_tokens: int


def prompt_corpus(target_dir: Path) -> list[int]:
    """The held-out prompts, tokenized by the target's tokenizer and joined: every stream's prompt is a window of it."""
    from transformers import AutoTokenizer  # heavy: only when a load test runs

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    corpus: list[int] = []
    for prompt in held_out_prompts():
        corpus.extend(tokenizer.encode(prompt, add_special_tokens=False))
    return corpus


def draw_streams(settings: LoadSettings, corpus: Sequence[int]) -> list[Stream]:
    """Each stream's prompt length and token budget drawn uniformly from the settings' ranges (seeded)."""
    longest = settings.prompt_tokens[1]
    if not corpus:
        raise ValueError("the held-out prompts tokenize to no tokens")
    repeated = list(corpus) * -(-longest // len(corpus))  # long enough for the longest window
    draw = random.Random(settings.seed)
    streams = []
    for index in range(settings.streams):
        length = draw.randint(*settings.prompt_tokens)
        start = draw.randrange(len(repeated) - length + 1)
        budget = draw.randint(*settings.new_tokens)
        streams.append(Stream(index, tuple(repeated[start : start + length]), budget))
    return streams


def stack_arguments(settings: LoadSettings) -> list[str]:
    """`tandem serve` options of the stack under test: the small pool, and a waiting queue that holds every stream."""
    return [
        "--target", str(settings.target_dir),
        "--draft", str(settings.draft_dir),
        "--port", "0",
        "--admin-port", "0",
        "--speculative-num-steps", str(settings.num_steps),
        "--kv-blocks", str(settings.kv_blocks),
        "--block-size", str(settings.block_size),
        "--max-waiting", str(max(settings.streams, SchedulerSettings.max_waiting)),
    ]  # fmt: skip


async def run_stream(stub: orchestrator_pb2_grpc.OrchestratorStub, stream: Stream) -> StreamResult:
    """One greedy stream to its end; a failed call is recorded with its status code, never raised."""
    request = orchestrator_pb2.GenerateRequest(
        input_ids=stream.input_ids, max_new_tokens=stream.max_new_tokens, ignore_eos=True
    )
    started = time.perf_counter()
    first_token: float | None = None
    tokens = 0
    finish_reason = ""
    error_code: str | None = None
    error_message = ""
    try:
        async for response in stub.Generate(request):
            if first_token is None and response.token_ids:
                first_token = time.perf_counter() - started
            tokens += len(response.token_ids)
            finish_reason = response.finish_reason or finish_reason
    except grpc.aio.AioRpcError as error:
        error_code, error_message = error.code().name, error.details() or ""
    if error_code is None and (not finish_reason or tokens != stream.max_new_tokens):
        # ignore_eos: a stream that ends without its whole budget lost tokens somewhere.
        error_code = "INCOMPLETE"
        error_message = f"{tokens} of {stream.max_new_tokens} tokens, finish_reason {finish_reason!r}"
    return StreamResult(
        index=stream.index,
        prompt_tokens=len(stream.input_ids),
        max_new_tokens=stream.max_new_tokens,
        completion_tokens=tokens,
        first_token_seconds=first_token,
        latency_seconds=time.perf_counter() - started,
        error_code=error_code,
        error_message=error_message,
    )


async def fire(address: str, streams: Sequence[Stream], timeout_s: float) -> tuple[list[StreamResult], float]:
    """Opens every stream at once; returns their results and the wall time until the last one ended."""
    results: list[StreamResult] = []
    progress = tqdm(total=len(streams), desc="load streams", unit="stream", file=sys.stderr)
    errors = 0

    async def one(stub: orchestrator_pb2_grpc.OrchestratorStub, stream: Stream) -> None:
        nonlocal errors
        result = await run_stream(stub, stream)
        results.append(result)
        errors += result.error_code is not None
        progress.set_postfix(errors=errors, refresh=False)
        progress.update()

    started = time.perf_counter()
    async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        try:
            await asyncio.wait_for(asyncio.gather(*(one(stub, stream) for stream in streams)), timeout_s)
        except asyncio.TimeoutError:
            raise LoadTimeout(
                f"only {len(results)} of {len(streams)} streams finished within the timeout of {timeout_s:.0f} s "
                "(--timeout); the stack was stopped and no report was written"
            ) from None
        finally:
            progress.close()
    return results, time.perf_counter() - started


async def kv_states(target_address: str, draft_addresses: dict[str, str]) -> list[KVState]:
    """Free and total KV blocks of the target and each draft replica, once every pool is whole again or after
    KV_SETTLE_S (then as they are)."""
    deadline = time.monotonic() + KV_SETTLE_S
    while True:
        states = []
        async with grpc.aio.insecure_channel(target_address, options=channel_options()) as channel:
            info = await target_pb2_grpc.TargetStub(channel).GetInfo(target_pb2.TargetInfoRequest(), timeout=10)
            states.append(KVState("target", info.kv_blocks_total, info.kv_blocks_free, info.running_requests))
        for name, address in sorted(draft_addresses.items()):
            async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
                draft = await draft_pb2_grpc.DraftStub(channel).GetInfo(draft_pb2.DraftInfoRequest(), timeout=10)
                states.append(KVState(name, draft.kv_blocks_total, draft.kv_blocks_free, draft.running_requests))
        if all(state.back for state in states) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.5)


async def draft_replicas(admin_address: str) -> dict[str, str]:
    """Each serving draft replica's address, by replica id (from the orchestrator's admin port)."""
    async with grpc.aio.insecure_channel(admin_address, options=channel_options()) as channel:
        admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
        listing = await admin.ListReplicas(orchestrator_pb2.ListReplicasRequest(), timeout=10)
    return {replica.replica_id: replica.address for replica in listing.replicas}


def _target_address(sampler: MemorySampler) -> str:
    orchestrator = sampler.processes().get("orchestrator")
    address = command_option(orchestrator, "--target-address") if orchestrator is not None else None
    if address is None:
        raise RuntimeError("the stack has no orchestrator process started with --target-address")
    return address


async def _measure(stack: ServeProcess, settings: LoadSettings, streams: Sequence[Stream]) -> LoadRun:
    sampler = MemorySampler(stack.process.pid, settings.sample_interval_s)
    sampler.start()
    try:
        results, wall = await fire(stack.address, streams, settings.timeout_s)
        assert stack.admin_address is not None  # the stack was started with an admin port
        kv = await kv_states(_target_address(sampler), await draft_replicas(stack.admin_address))
    finally:
        memory = sampler.stop()  # before the stack stops: VmHWM is read from the running processes
    preemptions = sum(int(found.group(1)) for line in stack.log if (found := PREEMPTION_LINE.search(line)))
    return LoadRun(results, wall, memory, kv, preemptions)


def run_load(settings: LoadSettings) -> tuple[Path, LoadRun]:
    """The load test end to end; returns the Markdown report's path and the run. Raises LoadTimeout."""
    settings.check()
    load_before = os.getloadavg()[0]  # other processes' load on a shared machine, before the stack adds its own
    streams = draw_streams(settings, prompt_corpus(settings.target_dir))
    print(f"tandem bench-load: starting tandem serve (--kv-blocks {settings.kv_blocks})", file=sys.stderr)
    stack = ServeProcess(stack_arguments(settings))
    try:
        run = asyncio.run(_measure(stack, settings, streams))
    finally:
        exit_code = stack.stop()
    return write(settings, run, load_before, exit_code), run
