"""Links that misbehave cost only time: each of the three links (orchestrator to target, orchestrator to replica,
replica to target) runs through a fault proxy, and 8 greedy and 2 seeded sampled streams are in flight when 50 ms of
latency, a reset of every connection, refused connections or a blackhole hits. Every stream ends with the tokens of a
run without the fault and without speculation; nothing stays held; the replica never exits and drafts again after.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.fault_proxy import FaultProxy
from tests.integration.fault_streams import (
    PROMPTS,
    assert_nothing_held,
    assert_streams_whole,
    streams_through,
    target_only,
    wait_for,
)
from tests.integration.stack import Service, generate, service, tandem_command

# Every service notices a silent peer within 2 s (--keepalive-timeout, 10 s by default: test_grpc_keepalive.py).
COMMON = ("--block-size", "8", "--orphan-timeout", "1", "--keepalive-timeout", "2")
LINKS = ("orchestrator-target", "orchestrator-replica", "replica-target")
BLACKHOLE_S = 4.0  # past the keepalive timeout: the connections are dropped and dialled again


@dataclass
class Stack:
    target: Service
    draft: Service
    orchestrator: Service
    proxies: dict[str, FaultProxy]  # by link
    expected: list[list[int]]


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("link-faults")
    with ExitStack() as services:
        target_command = tandem_command("target", "--model", str(llama_target), "--port", "0", *COMMON)
        target = services.enter_context(service("target", target_command, workdir))
        proxies = {"orchestrator-target": FaultProxy(target.address), "replica-target": FaultProxy(target.address)}
        draft_command = tandem_command(
            "draft", "--model", str(random_draft), "--target-address", proxies["replica-target"].address,
            "--port", "0", "--replica-id", "draft-0", "--speculative-num-steps", "3", *COMMON,
        )  # fmt: skip
        draft = services.enter_context(service("draft", draft_command, workdir))
        proxies["orchestrator-replica"] = FaultProxy(draft.address)
        for proxy in proxies.values():
            services.callback(proxy.close)
        orchestrator_command = tandem_command(
            "orchestrator", "--target-address", proxies["orchestrator-target"].address, "--tokenizer",
            str(llama_target), "--draft-address", proxies["orchestrator-replica"].address,
            "--speculative-num-steps", "3", "--no-adaptive-k", "--port", "0", "--admin-port", "0",
            "--target-timeout", "30", "--draft-timeout", "2", "--keepalive-timeout", "2",
        )  # fmt: skip
        orchestrator = services.enter_context(service("orchestrator", orchestrator_command, workdir))
        yield Stack(target, draft, orchestrator, proxies, target_only(orchestrator.address))


def latency(proxy: FaultProxy) -> Callable[[], None]:
    def fault() -> None:
        proxy.delay_s = 0.05
        time.sleep(2.0)  # the streams go on through it; it is lifted at the end of the test

    return fault


def refusal(proxy: FaultProxy) -> Callable[[], None]:
    def fault() -> None:
        proxy.refusing = True
        proxy.reset()
        time.sleep(3.0)
        proxy.refusing = False

    return fault


def blackhole(proxy: FaultProxy) -> Callable[[], None]:
    def fault() -> None:
        proxy.blackhole()
        time.sleep(BLACKHOLE_S)
        proxy.heal()

    return fault


def reset(proxy: FaultProxy) -> Callable[[], None]:
    return lambda: None if proxy.reset() > 0 else pytest.fail("no connection to reset")


@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("fault", [latency, reset, refusal, blackhole])
def test_a_misbehaving_link_costs_only_time(stack: Stack, link: str, fault: Callable[[FaultProxy], object]) -> None:
    proxy = stack.proxies[link]
    try:
        streams = streams_through(stack.orchestrator.address, fault(proxy))  # type: ignore[arg-type]
    finally:
        proxy.delay_s, proxy.refusing = 0.0, False
        proxy.heal()
    assert_streams_whole(streams, stack.expected)
    assert stack.draft.process.poll() is None, "".join(stack.draft.log[-20:])
    assert_nothing_held(stack.target.address, [stack.draft.address])
    wait_for(lambda: drafted(stack.orchestrator.address) > 0, "the replica drafts again", 60)


def drafted(address: str) -> int:
    return generate(address, input_ids=PROMPTS[0], max_new_tokens=8, ignore_eos=True).stats.draft_tokens
