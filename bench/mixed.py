"""`tandem bench-mixed`: a mixed stream through the HTTP API, each request class against its own target-only speed.

The stack (`tandem serve` with its HTTP API, the demo pair unless --target/--draft say otherwise) gets one stream of
requests from the official `openai` client, their classes interleaved (request i is of class i % 3):

    free code    a completion of held-out code (bench/prompts.py), to max_tokens
    json schema  a chat completion asking for the definition as JSON, with response_format a JSON schema
                 (bench/structured.py), to the document's end
    penalties    a completion of held-out code with presence and frequency penalties (bench/ab.py's), to max_tokens

all greedy. At each concurrency, after a warm-up (the stream once, speculatively), each repeat runs the stream twice
on the same servers: speculatively and with `disable_speculation` (target-only decoding), the order alternating from
repeat to repeat. A class's speed is its completion tokens over the seconds its requests were open (the sum of their
latencies: what its users wait), so a class slowed by the others' drafts shows although the stream's total does not.
Outputs are compared text for text. The orchestrator's `tandem:draft_length_rounds` counters, read around each
speculative run, give the k chosen per class (orchestrator/loop/draft_length.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from openai import AsyncOpenAI

from bench.ab import PENALTIES
from bench.harness import counter_totals, metrics_text
from bench.machine import machine
from bench.prompts import held_out_prompts
from bench.settings import MixedSettings
from bench.structured import SCHEMAS
from launch.processes import ServeProcess
from tandem.settings import DEMO_CHAT_TEMPLATE, DEMO_TARGET

CLASSES = ("free code", "json schema", "penalties")
METRIC_CLASS = {"free": "free code", "grammar": "json schema", "penalties": "penalties"}  # draft_length's names


@dataclass(frozen=True)
class Reply:
    request_class: str
    text: str
    tokens: int
    seconds: float


@dataclass
class Run:
    speculative: bool
    concurrency: int
    replies: dict[int, Reply] = field(default_factory=dict)  # by the request's place in the stream
    lengths: Counter[tuple[str, int]] = field(default_factory=Counter)  # (class, k) -> rounds, speculative runs

    def speed(self, request_class: str) -> float:
        """The class's completion tokens per second of its requests' latencies."""
        replies = [reply for reply in self.replies.values() if reply.request_class == request_class]
        return sum(reply.tokens for reply in replies) / max(1e-9, sum(reply.seconds for reply in replies))


async def _one(client: AsyncOpenAI, model: str, index: int, prompt: str, settings: MixedSettings, spec: bool) -> Reply:
    request_class = CLASSES[index % len(CLASSES)]
    extra: dict[str, Any] = {"disable_speculation": not spec}
    started = time.perf_counter()
    if request_class == "json schema":
        schema = SCHEMAS[(index // len(CLASSES)) % len(SCHEMAS)]
        chat = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"{prompt}# The definition above as JSON:"}],
            max_tokens=settings.max_new_tokens,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "definition", "schema": schema}},
            extra_body=extra,
        )
        text, usage = chat.choices[0].message.content or "", chat.usage
    else:
        penalised = request_class == "penalties"
        completion = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=settings.max_new_tokens,
            temperature=0.0,
            presence_penalty=PENALTIES["presence_penalty"] if penalised else 0.0,
            frequency_penalty=PENALTIES["frequency_penalty"] if penalised else 0.0,
            extra_body={**extra, "ignore_eos": True},
        )
        text, usage = completion.choices[0].text, completion.usage
    seconds = time.perf_counter() - started
    return Reply(request_class, text, usage.completion_tokens if usage else 0, seconds)


async def _run(client: AsyncOpenAI, model: str, prompts: Sequence[str], settings: MixedSettings, run: Run) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(prompts)):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            run.replies[index] = await _one(client, model, index, prompts[index], settings, run.speculative)

    await asyncio.gather(*(worker() for _ in range(run.concurrency)))


def draft_length_rounds(metrics_url: str) -> Counter[tuple[str, int]]:
    """The orchestrator's tandem:draft_length_rounds counters now, by (class as named here, k)."""
    rounds: Counter[tuple[str, int]] = Counter()
    for labels, value in counter_totals(metrics_text(metrics_url), "tandem:draft_length_rounds"):
        rounds[(METRIC_CLASS.get(labels["request_class"], "?"), int(labels["k"]))] += int(value)
    return rounds


async def _measure(stack: ServeProcess, settings: MixedSettings) -> list[Run]:
    prompts = held_out_prompts(settings.num_prompts)
    client = AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="none", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    runs: list[Run] = []
    try:
        for concurrency in settings.concurrency:
            # Warm-up: the stream once, speculatively, so that every measured run meets the server in its steady
            # state (the policy has seen every class and measured the batch sizes of this concurrency).
            await _run(client, model, prompts, settings, Run(True, concurrency))
            for repeat in range(settings.repeats):
                for speculative in (True, False) if repeat % 2 == 0 else (False, True):
                    run = Run(speculative, concurrency)
                    before = draft_length_rounds(f"{stack.http_url}/metrics")
                    await _run(client, model, prompts, settings, run)
                    if speculative:
                        run.lengths = draft_length_rounds(f"{stack.http_url}/metrics") - before
                    runs.append(run)
                    print(f"c={concurrency} repeat {repeat + 1} {'spec' if speculative else 'target-only'} done")
    finally:
        await client.close()
    return runs


def summary(runs: Sequence[Run], concurrency: int, request_class: str) -> dict[str, Any]:
    """One row: the class's speeds at a concurrency (medians over repeats), their ratio, identical outputs."""
    spec = [run for run in runs if run.concurrency == concurrency and run.speculative]
    plain = [run for run in runs if run.concurrency == concurrency and not run.speculative]
    spec_speeds = [run.speed(request_class) for run in spec]
    plain_speeds = [run.speed(request_class) for run in plain]
    ratios = [a / b for a, b in zip(spec_speeds, plain_speeds, strict=True) if b > 0]
    reference = plain[0].replies
    indices = [i for i, reply in reference.items() if reply.request_class == request_class]
    same = sum(all(run.replies[i].text == reference[i].text for run in [*spec, *plain]) for i in indices)
    lengths: Counter[int] = Counter()
    for run in spec:
        lengths.update({k: n for (name, k), n in run.lengths.items() if name == request_class})
    return {
        "concurrency": concurrency,
        "class": request_class,
        "speculative_tok_s": round(median(spec_speeds), 1),
        "target_only_tok_s": round(median(plain_speeds), 1),
        "ratio_median": round(median(ratios), 3),
        "ratios": [round(ratio, 3) for ratio in ratios],
        "speculative_runs": [round(speed, 1) for speed in spec_speeds],
        "target_only_runs": [round(speed, 1) for speed in plain_speeds],
        "identical": f"{same}/{len(indices)}",
        "rounds_by_k": {str(k): n for k, n in sorted(lengths.items())},
    }


def write(out: Path, rows: Sequence[dict[str, Any]], settings: MixedSettings) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    what = (
        f"{settings.num_prompts} requests a stream (classes interleaved), {settings.max_new_tokens} tokens at most, "
        f"greedy, {settings.repeats} repeats; machine: {machine()}"
    )
    (out / "latest.json").write_text(json.dumps({"what": what, "rows": rows}, indent=1) + "\n")
    lines = [
        "# A mixed stream through the HTTP API: each class against its own target-only speed",
        "",
        f"`tandem bench-mixed`: {what}.",
        "",
        "| c | class | speculative tok/s | target-only tok/s | ratio (median) | ratios | identical | rounds by k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        by_k = " ".join(f"{k}:{n}" for k, n in row["rounds_by_k"].items()) or "-"
        ratios = " ".join(f"{ratio:.2f}" for ratio in row["ratios"])
        lines.append(
            f"| {row['concurrency']} | {row['class']} | {row['speculative_tok_s']} | {row['target_only_tok_s']} | "
            f"{row['ratio_median']:.2f}x | {ratios} | {row['identical']} | {by_k} |"
        )
    (out / "latest.md").write_text("\n".join(lines) + "\n")
    return out / "latest.md"


def main(settings: MixedSettings) -> Path:
    arguments = ["--target", str(settings.target_dir), "--draft", str(settings.draft_dir)]
    template = settings.chat_template
    if template is None and settings.target_dir.resolve() == DEMO_TARGET.resolve():  # it ships beside the target
        template = DEMO_CHAT_TEMPLATE
    arguments += [] if template is None else ["--chat-template", str(template)]
    stack = ServeProcess([*arguments, "--port", "0", "--http-port", "0"])
    try:
        runs = asyncio.run(_measure(stack, settings))
    finally:
        stack.stop()
    rows = [summary(runs, c, request_class) for c in settings.concurrency for request_class in CLASSES]
    return write(settings.out, rows, settings)
