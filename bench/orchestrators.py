"""What a second orchestrator costs: the same load, N concurrent greedy streams, sent to one orchestrator or split
between two that share the target and the draft replica (as the chart's Deployment of two runs them). Interleaved
pairs (which runs first alternates); per pair the tokens per second of each and their ratio; the greedy tokens of
the two ways must be equal.

    python -m bench.orchestrators [--pairs 10] [--streams 16] [--tokens 64] [--out bench/results/orchestrators]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.fault_stack import Service, free_port, tandem
from bench.fault_streams import completion
from tandem.settings import DEMO_DRAFT, DEMO_TARGET

PROMPTS = [[1, 40 + index, 17, 99, 5, 23 + 3 * index, 8, 61] for index in range(64)]


def start(workdir: Path) -> list[Service]:
    """Target, draft replica and two orchestrators of the demo pair, each its own process; the orchestrators last."""
    ports = [free_port() for _ in range(4)]
    target, draft = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
    orchestrator = ["orchestrator", "--target-address", target, "--draft-address", draft, "--admin-port", "0"]
    services = [
        Service("target", tandem("target", "--model", str(DEMO_TARGET)), ports[0]),
        Service("draft", tandem("draft", "--model", str(DEMO_DRAFT), "--target-address", target), ports[1]),
        *(
            Service(f"orchestrator-{i}", tandem(*orchestrator, "--tokenizer", str(DEMO_TARGET)), ports[2 + i])
            for i in (0, 1)
        ),
    ]
    for service in services:
        service.start(workdir)
    return services


def load(addresses: list[str], streams: int, tokens: int) -> tuple[float, list[list[int]]]:
    """`streams` greedy requests at once, the i-th to addresses[i % len]; tokens per second and each one's tokens."""

    def one(index: int) -> list[int]:
        answer = completion(
            addresses[index % len(addresses)], input_ids=PROMPTS[index], max_new_tokens=tokens, ignore_eos=True
        )
        return list(answer.token_ids)

    began = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        outputs = list(pool.map(one, range(streams)))
    return sum(len(output) for output in outputs) / (time.perf_counter() - began), outputs


def run(pairs: int, streams: int, tokens: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as workdir:
        services = start(Path(workdir))
        try:
            one, two = [services[2].address], [services[2].address, services[3].address]
            load(two, streams, tokens)  # warm-up: both orchestrators and the target's shapes
            rates: dict[str, list[float]] = {"one": [], "two": []}
            for pair in range(pairs):
                order = [("one", one), ("two", two)] if pair % 2 == 0 else [("two", two), ("one", one)]
                outputs = {}
                for name, addresses in order:
                    rate, outputs[name] = load(addresses, streams, tokens)
                    rates[name].append(rate)
                if outputs["one"] != outputs["two"]:
                    raise AssertionError(f"pair {pair}: greedy tokens differ between one and two orchestrators")
        finally:
            for service in reversed(services):
                service.stop()
    ratios = [b / a for a, b in zip(rates["one"], rates["two"], strict=True)]
    return {
        "streams": streams,
        "tokens": tokens,
        "pairs": pairs,
        "tokens_per_second": rates,
        "ratio_two_over_one": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.orchestrators", description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/orchestrators"))
    args = parser.parse_args()
    result = run(args.pairs, args.streams, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratio_two_over_one"]))


if __name__ == "__main__":
    main()
