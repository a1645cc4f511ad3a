"""Records the demo pair's acceptance per request class, round by round, for the unit tests of
orchestrator/loop/draft_length.py.

    python -m bench.traces [--prompts 12] [--out tests/unit/data/acceptance_traces.json]

The colocated engine (bench/colocated.py: the scheduler, target and replica of `tandem serve` in one process) at a
fixed k of 5 runs the held-out prompts one at a time in each class: free text, each prompt's JSON schema
(bench/structured.py) and the penalties of bench/ab.py. A request's trace is what its rounds fed the choice of k, in
order: the drafter's tokens verified (the depth) and how many of them were accepted (tokens a grammar forced are
not the drafter's and not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.ab import PENALTIES
from bench.colocated import ColocatedEngine, ColocatedSettings
from bench.harness import run_prompts
from bench.prompts import held_out_prompts
from bench.structured import structured_prompts
from orchestrator.loop.draft_length import Survival
from tandem.settings import DEMO_DRAFT, DEMO_TARGET

K = 5
Trace = list[tuple[int, int]]  # (depth, accepted) of each round


async def _record(count: int) -> dict[str, list[Trace]]:
    engine = ColocatedEngine(ColocatedSettings(DEMO_TARGET, DEMO_DRAFT, num_steps=K, adaptive_k=False))
    policy = engine.scheduler.speculation
    observe = policy.observe_round
    rounds: dict[int, Trace] = {}  # by the request's own Survival (one object per request)
    owners: list[Survival] = []  # kept alive, so that no later request's object takes the same id

    def recording(request_class: str, own: Survival, depth: int, accepted: int) -> None:
        if id(own) not in rounds:
            owners.append(own)
        rounds.setdefault(id(own), []).append((depth, accepted))
        observe(request_class, own, depth, accepted)

    policy.observe_round = recording  # type: ignore[method-assign]
    prompts, schemas = structured_prompts(count)
    classes: dict[str, tuple[list[str], list[str], dict[str, float]]] = {
        "free": (held_out_prompts(count), [], {}),
        "grammar": (prompts, schemas, {}),
        "penalties": (held_out_prompts(count), [], PENALTIES),
    }
    traces = {}
    try:
        for name, (texts, constraint, options) in classes.items():
            rounds.clear()
            await run_prompts(engine.generate, texts, 1, 64, True, "traces", schemas=constraint, options=options)
            traces[name] = list(rounds.values())  # in the order the requests ran (one at a time)
    finally:
        await engine.close()
    return traces


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.traces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("tests/unit/data/acceptance_traces.json"))
    args = parser.parse_args(argv)
    traces = asyncio.run(_record(args.prompts))
    what = f"the demo pair, k = {K} fixed, greedy, 64 tokens, one request at a time; per request, (depth, accepted)"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": what, "traces": traces}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
