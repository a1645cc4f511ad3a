"""Fresh `tandem serve` starts of the demo pair, each serving the quickstart's request: does adaptive k draft at
full k after warm-up every time?

    python -m bench.cold_starts [--starts 20]

Each start warms both modes as the quickstart does, then streams its request and reads the request's statistics
and the orchestrator's /metrics (`tandem:k_settled`, `tandem:k_changes`). A start passes when the request drafted
k tokens in every round that could (max_new_tokens permitting) and batch size 1 is settled at full k. The log lines
of any k change are printed: the costs and acceptance that decided it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from bench.harness import GrpcGenerate
from bench.quickstart import STREAMED_PROMPT, STREAMED_TOKENS, WARMUP_PROMPT
from launch.processes import ServeProcess
from tandem.wire import orchestrator_pb2

NUM_STEPS = 5  # tandem serve's default --speculative-num-steps


@dataclass(frozen=True)
class Start:
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    settled: dict[str, float]  # batch size -> k
    changes: list[str]  # the log's adaptive-k lines

    @property
    def full_k(self) -> bool:
        """k never went below NUM_STEPS, and the rounds drafted NUM_STEPS tokens but for the last few (a round drafts
        fewer where fewer tokens are left to generate)."""
        drafted_fully = self.draft_tokens >= NUM_STEPS * (self.rounds - 3)
        return drafted_fully and not self.changes and self.settled.get("1", NUM_STEPS) == NUM_STEPS


def _settled(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.labels["batch_size"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tandem:k_settled"
        for sample in family.samples
    }


async def _serve_once(address: str) -> orchestrator_pb2.GenerateStats:
    generate = GrpcGenerate(address)
    try:
        for speculate in (True, False):
            request = orchestrator_pb2.GenerateRequest(
                prompt=WARMUP_PROMPT, max_new_tokens=8, disable_speculation=not speculate
            )
            async for _ in generate(request):
                pass
        stats = orchestrator_pb2.GenerateStats()
        request = orchestrator_pb2.GenerateRequest(
            prompt=STREAMED_PROMPT, max_new_tokens=STREAMED_TOKENS, ignore_eos=True
        )
        async for message in generate(request):
            if message.finish_reason:
                stats = message.stats
        return stats
    finally:
        await generate.close()


def one_start() -> Start:
    stack = ServeProcess(["--port", "0", "--admin-port", "0"])
    try:
        stats = asyncio.run(_serve_once(stack.address))
        settled = _settled(f"{stack.http_url}/metrics")
    finally:
        stack.stop()
    changes = [line.strip() for line in stack.log if "adaptive k for" in line]
    return Start(stats.rounds, stats.draft_tokens, stats.accepted_tokens, settled, changes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_starts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=20, help="fresh server starts (default 20)")
    args = parser.parse_args(argv)
    passed = 0
    for number in range(1, args.starts + 1):
        start = one_start()
        passed += start.full_k
        print(
            f"start {number}/{args.starts}: rounds={start.rounds} draft_tokens={start.draft_tokens} "
            f"accepted={start.accepted_tokens} settled k by batch size={start.settled} "
            f"{'full k' if start.full_k else 'NOT full k'}",
            flush=True,
        )
        for line in start.changes:
            print(f"    {line}", flush=True)
    print(f"{passed} of {args.starts} fresh starts drafted at full k after warm-up")
    return 0 if passed == args.starts else 1


if __name__ == "__main__":
    sys.exit(main())
