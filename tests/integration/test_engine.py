"""The engine under pressure and bad input, through a real `tandem serve`: a KV pool far smaller than the demand,
chunked prefill, a full queue, tiny temperatures, requests that can never fit, oversized input. Every request
either completes with the target-only greedy output or fails alone with the right code, and every KV block comes
back on target and draft."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.integration.stack import Completion, Stack, generate, serve, service_addresses
from tests.integration.test_serving import wait_until_idle

BLOCK_SIZE = 8
KV_BLOCKS = 14  # 112 positions, for target and draft
MAX_NUM_SEQS = 4
MAX_WAITING = 8
BUDGET = 24  # tokens per step: a long prompt takes several steps
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    options = [
        "--speculative-num-steps", "3",
        "--kv-blocks", str(KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(BUDGET),
        "--max-waiting", str(MAX_WAITING),
    ]  # fmt: skip
    with serve(llama_target, random_draft, *options) as running:
        yield running


def reference(target: Path, prompt: list[int], new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, attention_mask=None
        )
    return [int(t) for t in output[0, len(prompt) :]]


def prompt_ids(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [1, *torch.randint(3, 320, (length - 1,), generator=generator).tolist()]


def assert_nothing_held(stack: Stack) -> None:
    target, draft = wait_until_idle(service_addresses(stack.log))
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total) == (0, KV_BLOCKS)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)


def test_kv_oversubscribed_many_times_completes_with_target_only_outputs(stack: Stack, llama_target: Path) -> None:
    # 8 requests of 6 + 48 = 54 positions (7 blocks each): 56 blocks of demand on a pool of 14, and at most 4
    # running need 28. Requests are preempted and recomputed; outputs must not change.
    prompts = [prompt_ids(seed, 6) for seed in range(8)]
    expected = [reference(llama_target, prompt, NEW_TOKENS) for prompt in prompts]

    def one(prompt: list[int]) -> Completion:
        return generate(stack.address, input_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)

    with ThreadPoolExecutor(MAX_NUM_SEQS + MAX_WAITING) as pool:
        completions = list(pool.map(one, prompts))
    assert [c.token_ids for c in completions] == expected
    assert sum(c.stats.rounds for c in completions) > 0
    assert any("KV pool full: preempting" in line for line in stack.log)
    assert_nothing_held(stack)


def test_long_prompt_is_prefilled_in_chunks_while_short_requests_stream(stack: Stack, llama_target: Path) -> None:
    long_prompt = prompt_ids(100, 90)  # 4 steps of prompt chunks at 24 tokens a step
    short_prompts = [prompt_ids(seed, 5) for seed in (101, 102)]
    with ThreadPoolExecutor(3) as pool:
        long = pool.submit(generate, stack.address, input_ids=long_prompt, max_new_tokens=16, ignore_eos=True)
        shorts = [
            pool.submit(generate, stack.address, input_ids=prompt, max_new_tokens=24, ignore_eos=True)
            for prompt in short_prompts
        ]
        assert long.result().token_ids == reference(llama_target, long_prompt, 16)
        for prompt, short in zip(short_prompts, shorts, strict=True):
            assert short.result().token_ids == reference(llama_target, prompt, 24)
    assert_nothing_held(stack)


@pytest.mark.parametrize("temperature", [1e-40, 2e-38, 1e-30])
def test_tiny_temperature_behaves_as_greedy(stack: Stack, temperature: float) -> None:
    prompt = prompt_ids(7, 6)
    greedy = generate(stack.address, input_ids=prompt, max_new_tokens=20, ignore_eos=True)
    tiny = generate(stack.address, input_ids=prompt, max_new_tokens=20, ignore_eos=True, temperature=temperature)
    assert tiny.finish_reason == "length"
    assert tiny.token_ids == greedy.token_ids
    assert_nothing_held(stack)


BAD = [
    ({"input_ids": prompt_ids(1, 80), "max_new_tokens": 40}, "max_new_tokens: a 80-token prompt and 40 new tokens"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop: 17 strings, at most 16"),
    ({"prompt": "x", "stop": ["s" * 257]}, "stop[0]: 257 characters, at most 256"),
    ({"prompt": "x" * (512 * 64 + 1)}, "prompt: 32769 characters cannot fit the context of 512 tokens"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_bad_requests_fail_alone_before_any_work(stack: Stack, fields: dict[str, object], message: str) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        generate(stack.address, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert caught.value.details().startswith(message), caught.value.details()  # type: ignore[attr-defined]
    assert time.monotonic() - started < 5.0
    assert_nothing_held(stack)


def test_a_full_queue_refuses_with_resource_exhausted_and_serves_the_rest(stack: Stack) -> None:
    count = MAX_NUM_SEQS + MAX_WAITING + 6

    def one(seed: int) -> Completion | grpc.RpcError:
        try:
            return generate(stack.address, input_ids=prompt_ids(seed, 6), max_new_tokens=40, ignore_eos=True)
        except grpc.RpcError as error:
            return error

    with ThreadPoolExecutor(count) as pool:
        outcomes = list(pool.map(one, range(200, 200 + count)))
    refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
    served = [o for o in outcomes if isinstance(o, Completion)]
    assert refused, "no request found the queue full"
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "waiting queue holds its maximum of 8 requests" in error.details()  # type: ignore[attr-defined]
    assert len(served) >= MAX_WAITING
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in served)
    assert_nothing_held(stack)
