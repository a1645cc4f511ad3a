"""SIGTERM to `tandem serve` under load: the orchestrator drains. Its streams in flight, 8 greedy and 2 seeded
sampled over gRPC and one greedy SSE stream of the HTTP API, finish with the output of a run without the signal; a
request sent meanwhile is refused with UNAVAILABLE within a second; the stack exits 0 and the orchestrator logs that
every stream finished."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai

from tests.integration.stack import generate, serve

TOKENS = 96
DRAINED = re.compile(r"drained: (\d+) streams finished, 0 ended by the shutdown")
GREEDY = [dict(prompt=f"def function_{index}(value):\n    return", max_new_tokens=TOKENS) for index in range(8)]
SEEDED = [dict(prompt=f"class Item{index}:", max_new_tokens=TOKENS, temperature=0.8, seed=index) for index in (1, 2)]
REQUESTS = [*GREEDY, *SEEDED]


def tokens(address: str, request: dict[str, object]) -> list[int]:
    return generate(address, ignore_eos=True, **request).token_ids


def streamed_text(client: openai.OpenAI) -> str:
    """An SSE stream of the HTTP API, greedy: its text."""
    model = client.models.list().data[0].id
    prompt = "def parse(text):"
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def refused_after(address: str, started: float) -> tuple[float, grpc.RpcError]:
    """Sends one-token requests until one is refused; returns when (seconds after `started`) and the error."""
    while True:
        try:
            generate(address, prompt="x = 1", max_new_tokens=1)
        except grpc.RpcError as error:
            return time.monotonic() - started, error
        assert time.monotonic() - started < 10, "new requests were still served 10 s after SIGTERM"


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_ones(llama_target: Path, random_draft: Path) -> None:
    flags = ("--speculative-num-steps", "3", "--shutdown-timeout", "30", "--http-port", "0")
    with serve(llama_target, random_draft, *flags) as stack:
        client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(REQUESTS) + 1) as pool:
            reference = list(pool.map(lambda request: tokens(stack.address, request), REQUESTS))
            text = streamed_text(client)
            futures = [pool.submit(tokens, stack.address, request) for request in REQUESTS]
            sse = pool.submit(streamed_text, client)
            time.sleep(0.5)  # the streams are running
            assert not any(future.done() for future in [*futures, sse])
            started = time.monotonic()
            stack.process.send_signal(signal.SIGTERM)
            seconds, error = refused_after(stack.address, started)
            drained = [future.result(timeout=120) for future in futures]
            assert sse.result(timeout=120) == text
        assert stack.process.wait(timeout=60) == 0
    assert drained == reference
    assert seconds < 1.0 and error.code() is grpc.StatusCode.UNAVAILABLE, (seconds, error)
    assert "shutting down" in (error.details() or "")
    # The eleven, and a probe sent just before the drain began.
    [finished] = [int(found.group(1)) for line in stack.log if (found := DRAINED.search(line))]
    assert finished >= len(REQUESTS) + 1, [line for line in stack.log if "drain" in line]
