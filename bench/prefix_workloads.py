"""`tandem bench --workload shared-prefix | multi-turn`: what the prefix caches give, as the peers measure it.

    shared-prefix  vLLM's prefix_repetition shape: --num-prefixes prefixes of --prefix-len tokens, each sent with
                   --requests-per-prefix suffixes of --suffix-len tokens, prefix by prefix in turn (every prefix's
                   first request, then every second one, ...), --concurrency requests at a time
    multi-turn     --conversations chats at once, of --turns turns each: a turn's prompt is the last one, its reply
                   and a new user message of --user-len tokens; the first turn's is --prefix-len tokens

Every request generates --max-new-tokens greedy tokens of text built from the held-out code (bench/prompts.py), as
token ids. Two stacks serve the same target and draft, one with the prefix caches (the default) and one started with
--no-enable-prefix-caching; each repeat runs the workload four times, interleaved (cache on and off, each with
speculation and with `disable_speculation`), the order reversed every other repeat, after one warm-up request of
--prefix-len tokens in each mode. Each run's requests share a
cache_salt of their own, so a run reuses only what its own requests computed. Tokens are compared request by request
across the four runs of a repeat.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from bench.harness import GrpcGenerate, counter_totals, metrics_text
from bench.prompts import held_out_prompts
from bench.settings import BenchSettings
from tandem.wire import orchestrator_pb2

MODES = (("cache", True), ("cache", False), ("no cache", True), ("no cache", False))  # (stack, speculative)
DRAFT_COUNTERS = ("tandem:draft_prefix_cache_queries", "tandem:draft_prefix_cache_hits")


@dataclass(frozen=True)
class Answer:
    """One request of a run: which one (group: prefix or conversation; index: repeat or turn), and what it got."""

    group: int
    index: int
    prompt_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]
    first_token_seconds: float
    rounds: int
    accepted_tokens: int


@dataclass(frozen=True)
class WorkloadRun:
    stack: str  # "cache" or "no cache"
    speculative: bool
    repeat: int
    wall_seconds: float
    answers: tuple[Answer, ...]
    draft_queried: float  # tokens the replica was asked to take from its own prefix cache, and found
    draft_cached: float


def token_pool(target_dir: Path, needed: int) -> list[int]:
    """At least `needed` token ids of held-out code, the prompts one after another as often as it takes."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = "".join(held_out_prompts(32))
    tokens: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (tokens * (needed // len(tokens) + 1))[:needed]


class Texts:
    """Consecutive, never repeated slices of the token pool: every prefix, suffix and user message its own."""

    def __init__(self, pool: Sequence[int]) -> None:
        self.pool = pool
        self.offset = 0

    def take(self, length: int) -> tuple[int, ...]:
        piece = tuple(self.pool[self.offset : self.offset + length])
        self.offset += length
        return piece


async def _ask(
    generate: GrpcGenerate, prompt: Sequence[int], settings: BenchSettings, speculative: bool, salt: str
) -> tuple[orchestrator_pb2.GenerateStats, tuple[int, ...], float]:  # -> stats, tokens, first-token seconds
    request = orchestrator_pb2.GenerateRequest(
        input_ids=prompt,
        max_new_tokens=settings.max_new_tokens,
        ignore_eos=True,
        disable_speculation=not speculative,
        cache_salt=salt,
    )
    started = time.perf_counter()
    first, tokens = 0.0, list[int]()
    async for message in generate(request):
        if message.token_ids and not tokens:
            first = time.perf_counter() - started
        tokens.extend(message.token_ids)
        if message.finish_reason:
            return message.stats, tuple(tokens), first
    raise RuntimeError("a stream ended without finish_reason")


def _answer(group: int, index: int, reply: tuple[orchestrator_pb2.GenerateStats, tuple[int, ...], float]) -> Answer:
    stats, tokens, first = reply
    return Answer(
        group, index, stats.prompt_tokens, stats.cached_tokens, tokens, first, stats.rounds, stats.accepted_tokens
    )


async def shared_prefix(
    generate: GrpcGenerate, settings: BenchSettings, speculative: bool, salt: str, concurrency: int
) -> list[Answer]:
    shape = settings.prefix
    texts = Texts(token_pool(settings.target_dir, shape.num_prefixes * shape.prefix_len))
    prefixes = [texts.take(shape.prefix_len) for _ in range(shape.num_prefixes)]
    pool = token_pool(settings.target_dir, shape.suffix_len * shape.requests_per_prefix * shape.num_prefixes + 97)
    suffixes = Texts(pool[97:])  # another stretch of code than the prefixes' first tokens
    queue: asyncio.Queue[tuple[int, int, tuple[int, ...]]] = asyncio.Queue()
    for index in range(shape.requests_per_prefix):
        for group, prefix in enumerate(prefixes):
            queue.put_nowait((group, index, prefix + suffixes.take(shape.suffix_len)))
    answers: list[Answer] = []

    async def worker() -> None:
        while not queue.empty():
            group, index, prompt = queue.get_nowait()
            answers.append(_answer(group, index, await _ask(generate, prompt, settings, speculative, salt)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return answers


async def multi_turn(generate: GrpcGenerate, settings: BenchSettings, speculative: bool, salt: str) -> list[Answer]:
    shape = settings.prefix
    needed = shape.conversations * (shape.prefix_len + shape.turns * shape.user_len)
    texts = Texts(token_pool(settings.target_dir, needed))
    openers = [texts.take(shape.prefix_len) for _ in range(shape.conversations)]
    users = [[texts.take(shape.user_len) for _ in range(shape.turns)] for _ in range(shape.conversations)]

    async def conversation(group: int) -> list[Answer]:
        prompt, answers = openers[group], []
        for turn in range(shape.turns):
            reply = await _ask(generate, prompt, settings, speculative, salt)
            answers.append(_answer(group, turn, reply))
            prompt = prompt + reply[1] + users[group][turn]
        return answers

    chats = await asyncio.gather(*(conversation(group) for group in range(shape.conversations)))
    return [answer for chat in chats for answer in chat]


async def run_workload(
    settings: BenchSettings, addresses: dict[str, str], metrics: dict[str, str], concurrency: int
) -> list[WorkloadRun]:
    """Every mode `repeats` times, interleaved; `addresses` and `metrics` (the /metrics URLs) by stack name."""
    clients = {name: GrpcGenerate(address) for name, address in addresses.items()}
    runs = []
    try:
        warm_up = token_pool(settings.target_dir, settings.prefix.prefix_len)
        for client, speculative in itertools.product(clients.values(), (True, False)):  # first shapes' kernels
            await _ask(client, warm_up, settings, speculative, f"warm-up {speculative}")
        for repeat in range(settings.repeats):
            order = MODES if repeat % 2 == 0 else MODES[::-1]
            for stack, speculative in order:
                salt = f"run {repeat} {stack} {speculative}"
                before = _draft_counters(metrics[stack])
                started = time.perf_counter()
                if settings.prefix.workload == "shared-prefix":
                    answers = await shared_prefix(clients[stack], settings, speculative, salt, concurrency)
                else:
                    answers = await multi_turn(clients[stack], settings, speculative, salt)
                wall = time.perf_counter() - started
                after = _draft_counters(metrics[stack])
                queried, cached = (after[i] - before[i] for i in range(2))
                runs.append(WorkloadRun(stack, speculative, repeat, wall, tuple(answers), queried, cached))
                print(f"{settings.prefix.workload} repeat {repeat}: {stack}, speculative {speculative}: {wall:.1f} s")
    finally:
        for client in clients.values():
            await client.close()
    return runs


def _draft_counters(metrics_url: str) -> tuple[float, float]:
    text = metrics_text(metrics_url)
    totals = [sum(value for _, value in counter_totals(text, name)) for name in DRAFT_COUNTERS]
    return totals[0], totals[1]
