"""Standalone draft models through the real stack (`tandem serve --target T --draft D`, D a plain causal LM with T's
vocabulary): greedy speculative output == target-only output, the target as its own draft has every draft accepted,
a replica of one joins and dies like any replica, and a draft with another vocabulary or tokenizer is refused at
start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tandem.grpc_util import channel_options
from tandem.models.tokenizer_digest import tokenizer_digest
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.integration.stack import (
    Completion,
    Stack,
    draft_info,
    generate,
    run_to_exit,
    serve,
    service_addresses,
    tandem_command,
)
from tests.integration.test_engine import prompt_ids
from tests.integration.test_serving import wait_until_idle

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os", "class Parser:"]
MAX_NEW_TOKENS = 24
STEPS = 4
# A smaller Llama with the target's vocabulary (320): what a real standalone draft is to its target.
DRAFT_SPEC = TinyTargetSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("small-llama"), DRAFT_SPEC)


@pytest.fixture(scope="module")
def small_llama_stack(llama_target: Path, small_llama: Path) -> Iterator[Stack]:
    """The target with the smaller Llama as its draft, started once: the first test drafts on it as started, the
    next (its last user) adds a second replica to it and kills that."""
    with serve(llama_target, small_llama, "--speculative-num-steps", str(STEPS)) as stack:
        yield stack


def greedy(address: str, prompt: str, disable_speculation: bool = False) -> Completion:
    completion = generate(
        address,
        prompt=prompt,
        max_new_tokens=MAX_NEW_TOKENS,
        ignore_eos=True,
        disable_speculation=disable_speculation,
    )
    assert completion.finish_reason == "length"
    return completion


def test_smaller_llama_drafts_and_greedy_output_equals_target_only(small_llama_stack: Stack) -> None:
    stack = small_llama_stack
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched across requests on the replica
        speculative = list(pool.map(lambda prompt: greedy(stack.address, prompt), PROMPTS))
    target_only = [greedy(stack.address, prompt, disable_speculation=True).token_ids for prompt in PROMPTS]
    info = draft_info(service_addresses(stack.log)["draft"])
    subscribed = [line for line in stack.log if "subscribed, tokens only" in line]
    assert (info.kind, info.architecture, list(info.capture_indices)) == ("standalone", "LlamaForCausalLM", [])
    assert subscribed, "the replica subscribes for tokens only"
    assert [completion.token_ids for completion in speculative] == target_only
    for completion in speculative:
        assert completion.stats.draft_tokens >= completion.stats.rounds > 0


def test_a_standalone_replica_joins_and_dies_like_any_replica(
    tmp_path: Path, small_llama: Path, small_llama_stack: Stack
) -> None:
    stack = small_llama_stack
    ready_file = tmp_path / "second-draft.address"
    arguments = ["draft", "--model", str(small_llama), "--target-address", service_addresses(stack.log)["target"]]
    arguments += ["--replica-id", "draft-second", "--port", "0", "--ready-file", str(ready_file)]
    second = subprocess.Popen(tandem_command(*arguments), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not ready_file.exists():
            assert second.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address = ready_file.read_text()
        assert stack.admin_address is not None
        with grpc.insecure_channel(stack.admin_address, options=channel_options()) as channel:
            admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
            added = admin.AddReplica(orchestrator_pb2.AddReplicaRequest(address=address))
        assert (added.replica_id, added.state) == ("draft-second", "serving")
        prompts = [f"def function_{index}(value):" for index in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(greedy, stack.address, prompt) for prompt in prompts]
            # SIGKILL the second replica once it drafts for some of them (or once they are all done).
            while draft_info(address).running_requests == 0 and not all(f.done() for f in futures):
                assert time.monotonic() < deadline + 120
                time.sleep(0.05)
            os.kill(second.pid, signal.SIGKILL)
            speculative = [future.result(timeout=300).token_ids for future in futures]
        target_only = [greedy(stack.address, prompt, disable_speculation=True).token_ids for prompt in prompts]
    finally:
        second.kill()
        second.wait()
    assert speculative == target_only


def test_the_target_as_its_own_draft_is_accepted_in_full(llama_target: Path) -> None:
    with serve(llama_target, llama_target, "--speculative-num-steps", str(STEPS)) as stack:
        speculative = [greedy(stack.address, prompt) for prompt in PROMPTS]
        target_only = [greedy(stack.address, prompt, disable_speculation=True).token_ids for prompt in PROMPTS]
    assert [completion.token_ids for completion in speculative] == target_only
    for completion in speculative:
        stats = completion.stats
        assert stats.draft_tokens > 0
        assert stats.accepted_tokens == stats.draft_tokens
        # Every full round drafts k and commits k + 1 (acceptance length k + 1); only the last ones are cut short
        # by max_new_tokens.
        assert stats.accepted_per_position[0] == stats.rounds
        assert stats.accepted_per_position[STEPS - 1] >= 1


def test_preemption_and_chunked_prefill_keep_target_only_output(llama_target: Path) -> None:
    # A pool of 14 blocks of 8 for 8 requests of 54 positions each: requests are preempted and recomputed in chunks
    # of the 24-token budget (their draft restarts from x[0]), and the draft's equal pool runs short too.
    options = ["--speculative-num-steps", "3", "--kv-blocks", "14", "--block-size", "8"]
    options += ["--max-num-seqs", "4", "--max-num-batched-tokens", "24"]
    prompts = [prompt_ids(seed, 6) for seed in range(8)]

    def one(prompt: list[int], disable_speculation: bool = False) -> Completion:
        return generate(
            stack.address,
            input_ids=prompt,
            max_new_tokens=48,
            ignore_eos=True,
            disable_speculation=disable_speculation,
        )

    with serve(llama_target, llama_target, *options) as stack:
        with ThreadPoolExecutor(len(prompts)) as pool:
            speculative = list(pool.map(one, prompts))
        target_only = [one(prompt, disable_speculation=True).token_ids for prompt in prompts]
        preempted = any("KV pool full: preempting" in line for line in stack.log)
        demoted = [line for line in stack.log if "demoted" in line]
        target, draft = wait_until_idle(service_addresses(stack.log))
    assert preempted
    assert not demoted, demoted
    assert [completion.token_ids for completion in speculative] == target_only
    assert sum(completion.stats.accepted_tokens for completion in speculative) > 0
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused_naming_both(
    tmp_path: Path, llama_target: Path
) -> None:
    # vocab_size 384, and a tokenizer trained to 384 tokens: both differ from the target's (320).
    draft = write_tiny_target(tmp_path / "draft", TinyTargetSpec(vocab_size=384, num_layers=2))
    result = run_to_exit(["serve", "--target", str(llama_target), "--port", "0", "--draft", str(draft)])
    assert result.returncode != 0, result.stdout
    assert "tandem ready" not in result.stdout
    assert "the draft has vocab_size 384, the target has vocab_size 320" in result.stdout
    ours, theirs = tokenizer_digest(draft)[:16], tokenizer_digest(llama_target)[:16]
    assert f"the draft has {ours}, the target has {theirs}" in result.stdout
