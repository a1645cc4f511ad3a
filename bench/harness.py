"""Runs a prompt set at a given concurrency against a generate function and summarises the results."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.structured import CONSTRAINED
from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc


@dataclass(frozen=True)
class RequestResult:
    prompt_index: int  # into the run's prompt list
    token_ids: tuple[int, ...]  # the completion
    completion_tokens: int
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    latency_seconds: float
    first_token_seconds: float


@dataclass(frozen=True)
class RunResult:
    label: str  # "split" (three processes, gRPC) or "colocated" (one process)
    speculative: bool
    concurrency: int
    wall_seconds: float
    requests: tuple[RequestResult, ...]
    kind: str = ""  # the draft kind of a speculative run measured beside others (bench/kinds.py); "" otherwise
    constraint: str = ""  # what constrained its requests (bench.structured.CONSTRAINED); "": free text
    # CPU seconds the run cost, by process role (bench.cpu); empty where not measured (transformers)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    # Where the run's rounds spent their time, by part (the orchestrator's tandem:round_seconds counters over the
    # run: draft, verify, wire, scheduling, drafted_ahead); empty where not measured.
    round_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall_seconds

    @property
    def rounds(self) -> int:
        return sum(r.rounds for r in self.requests)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / rounds: tokens committed per target verification (bonus included)."""
        return 1 + sum(r.accepted_tokens for r in self.requests) / max(1, self.rounds)

    def cpu_milliseconds_per_token(self) -> dict[str, float]:
        """CPU milliseconds by process role per completion token."""
        tokens = max(1, self.completion_tokens)
        return {role: 1000 * seconds / tokens for role, seconds in self.cpu_seconds.items()}

    @property
    def cores_busy(self) -> float:
        """CPU seconds of every measured process over the run's wall time: how many cores it kept busy."""
        return sum(self.cpu_seconds.values()) / self.wall_seconds

    def outputs(self) -> dict[int, tuple[int, ...]]:
        """Each prompt's completion, by prompt index."""
        return {request.prompt_index: request.token_ids for request in self.requests}

    def acceptance_per_position(self) -> list[float]:
        """Fraction of rounds in which draft position i was accepted."""
        width = max((len(r.accepted_per_position) for r in self.requests), default=0)
        totals = [0] * width
        for request in self.requests:
            for position, accepted in enumerate(request.accepted_per_position):
                totals[position] += accepted
        return [total / max(1, self.rounds) for total in totals]

    def per_round_milliseconds(self) -> dict[str, float]:
        """Mean time per round by part, averaged over requests' rounds."""
        rounds = max(1, self.rounds)
        return {
            **{part: 1000 * seconds / rounds for part, seconds in self.round_seconds.items()},
            # Wall time of a round as the client saw it: from the first token (the prompt's step) to the last. The
            # first round starts when the first token leaves the orchestrator, before the client has it: a client
            # that gets it late (a loaded machine) sees rounds shorter than their compute.
            "round": 1000 * sum(r.latency_seconds - r.first_token_seconds for r in self.requests) / rounds,
            # The same from the request's start (prompt and queue included): the bound the compute always fits in.
            "request": 1000 * sum(r.latency_seconds for r in self.requests) / rounds,
        }

    def outside_compute_ms_per_token(self) -> float | None:
        """Milliseconds per token decoded after the first in which neither target nor draft computed (None: the
        run's parts were not measured)."""
        per_round = self.per_round_milliseconds()
        outside = outside_compute(per_round)
        decoded = sum(max(0, request.completion_tokens - 1) for request in self.requests)
        return None if outside is None or not decoded else outside * max(1, self.rounds) / decoded


def outside_compute(per_round: dict[str, float]) -> float | None:
    """Milliseconds of a round in which neither target nor draft computed: transport, hand-offs, scheduling, and
    whatever else the stack did that the phases leave out (releasing a finished request, for one).

    It is the round's wall time less its compute: the target's, the draft compute the round waited for, and the
    draft compute done ahead, which ran after the target's compute and before the Propose arrived, so while the
    target's answer and the Propose travelled (inside the wire time). Example: a 20.3 ms round with 13.1 ms of
    verification, 4.5 ms of draft waited for and 1.7 ms drafted ahead spent 1.0 ms outside compute, where its wire
    and scheduling add up to 2.6 ms. None where the run's parts were not measured (a stack started elsewhere).
    """
    if "verify" not in per_round:
        return None
    compute = per_round["verify"] + per_round["draft"] + per_round.get("drafted_ahead", 0.0)
    return max(0.0, per_round["round"] - compute)


Generate = Callable[[orchestrator_pb2.GenerateRequest], AsyncIterator[orchestrator_pb2.GenerateResponse]]
# Reads a stack's tandem:round_seconds counters now, by part (the run's share is the difference over the run).
RoundSeconds = Callable[[], dict[str, float]]


def metrics_text(metrics_url: str) -> str:
    """A running orchestrator's /metrics text."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return str(response.read().decode())


def counter_totals(exposition: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """The labels and value of each sample of the counter `name` in a /metrics text."""
    for family in text_string_to_metric_families(exposition):
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    yield sample.labels, sample.value


def round_seconds_of(exposition: str) -> dict[str, float]:
    """The tandem:round_seconds counters by part in an orchestrator's /metrics text (summed over model names)."""
    totals: dict[str, float] = {}
    for labels, value in counter_totals(exposition, "tandem:round_seconds"):
        totals[labels["part"]] = totals.get(labels["part"], 0.0) + value
    return totals


def scraped_round_seconds(metrics_url: str) -> RoundSeconds:
    """Reads the counters from a running orchestrator's /metrics."""
    return lambda: round_seconds_of(metrics_text(metrics_url))


async def run_prompts(
    generate: Generate,
    prompts: Sequence[str],
    concurrency: int,
    max_new_tokens: int,
    speculative: bool,
    label: str,
    kind: str = "",
    schemas: Sequence[str] = (),
    options: Mapping[str, object] = {},
) -> RunResult:
    """Greedy completions of every prompt, `concurrency` at a time; wall time covers the whole set. With `schemas`
    (one JSON schema per prompt) each request is constrained by its prompt's and ends with its document; `options`
    are more GenerateRequest fields for every request (penalties)."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    results: list[RequestResult] = []
    constraint = CONSTRAINED if schemas else ""
    mode = f"spec {kind}".rstrip() if speculative else "target-only"
    mode = f"{mode} {constraint}".rstrip()
    progress = tqdm(total=len(prompts), desc=f"{label} {mode} c={concurrency}")

    async def worker() -> None:
        while not queue.empty():
            index, prompt = queue.get_nowait()
            request = orchestrator_pb2.GenerateRequest(
                prompt=prompt,
                max_new_tokens=max_new_tokens,
                ignore_eos=not schemas,
                disable_speculation=not speculative,
                json_schema=schemas[index] if schemas else "",
            )
            for name, value in options.items():
                if isinstance(value, Mapping):  # logit_bias
                    getattr(request, name).update(value)
                else:
                    setattr(request, name, value)
            results.append(await _one(generate, request, index))
            progress.update()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    progress.close()
    return RunResult(label, speculative, concurrency, wall, tuple(results), kind, constraint)


async def _one(generate: Generate, request: orchestrator_pb2.GenerateRequest, prompt_index: int) -> RequestResult:
    started = time.perf_counter()
    first_token = None
    token_ids: list[int] = []
    async for message in generate(request):
        if first_token is None:
            first_token = time.perf_counter() - started
        token_ids.extend(message.token_ids)
        if message.finish_reason:
            stats = message.stats
            return RequestResult(
                prompt_index=prompt_index,
                token_ids=tuple(token_ids),
                completion_tokens=stats.completion_tokens,
                rounds=stats.rounds,
                draft_tokens=stats.draft_tokens,
                accepted_tokens=stats.accepted_tokens,
                accepted_per_position=tuple(stats.accepted_per_position),
                latency_seconds=time.perf_counter() - started,
                first_token_seconds=first_token or 0.0,
            )
    raise RuntimeError("a stream ended without finish_reason")


class GrpcGenerate:
    """Generate over gRPC against a running orchestrator (one channel shared by all workers)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        self.stub = orchestrator_pb2_grpc.OrchestratorStub(self.channel)

    async def __call__(
        self, request: orchestrator_pb2.GenerateRequest
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        async for response in self.stub.Generate(request):
            yield response

    async def close(self) -> None:
        await self.channel.close()
