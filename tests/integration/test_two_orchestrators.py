"""Two orchestrators against one target and one draft replica, as the chart's orchestrator Deployment runs them with
replicas: 2. Each owns its requests; the target's KV pool, too small for both loads at once, is never overcommitted:
an orchestrator the target refuses room waits or preempts its own requests, every stream ends with the tokens one
orchestrator alone gives it, and nothing stays held. (One of two killed while the other serves its resumes:
test_fault_scenarios, "kill orchestrator, second takes over".)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.fault_streams import held_after
from tests.integration.stack import Service, generate, service, tandem_command

# 20 blocks of 8 tokens: each of the 8 requests needs 4 or 5, so the two loads together need about twice the pool.
POOL = ("--kv-blocks", "20", "--block-size", "8", "--orphan-timeout", "1")
NEW_TOKENS = 24
PROMPTS = [f"def two_orchestrators_{index}(values):" for index in range(8)]


@dataclass
class Stack:
    target: Service
    draft: Service
    orchestrators: list[Service]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("two-orchestrators")
    with ExitStack() as services:
        target = services.enter_context(
            service("target", tandem_command("target", "--model", str(llama_target), "--port", "0", *POOL), workdir)
        )
        draft_command = tandem_command("draft", "--model", str(random_draft), "--target-address", target.address)
        draft = services.enter_context(service("draft", [*draft_command, "--port", "0", *POOL[2:]], workdir))
        orchestrator_command = tandem_command(
            "orchestrator", "--target-address", target.address, "--draft-address", draft.address
        )
        orchestrator_command += ["--tokenizer", str(llama_target), "--port", "0", "--admin-port", "0"]
        orchestrator_command += ["--speculative-num-steps", "3", "--no-adaptive-k"]
        orchestrators = [
            services.enter_context(service(f"orchestrator-{index}", orchestrator_command, workdir)) for index in (0, 1)
        ]
        yield Stack(target, draft, orchestrators)


def request(prompt: str) -> dict[str, object]:
    return {"prompt": prompt, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def test_two_orchestrators_share_a_pool_too_small_for_both(stack: Stack) -> None:
    first = stack.orchestrators[0].address
    addresses = [stack.orchestrators[index % 2].address for index in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # The reference: one orchestrator, no drafts (it preempts for its own pressure alone).
        alone = list(pool.map(lambda prompt: generate(first, **request(prompt), disable_speculation=True), PROMPTS))
        both = list(pool.map(lambda address, prompt: generate(address, **request(prompt)), addresses, PROMPTS))
    assert [answer.token_ids for answer in both] == [answer.token_ids for answer in alone]
    assert held_after(stack.target.address, [stack.draft.address]) == (0, 0)
