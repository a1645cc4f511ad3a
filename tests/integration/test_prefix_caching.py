"""The prefix caches through `tandem serve` on the demo pair: a repeated prompt's usage counts the cached tokens
(gRPC stats, HTTP usage, streamed usage, /metrics), salts keep requests apart, the replicas (EAGLE3, DFlash) reuse
their own draft context where the target skipped a prefix, and the tokens are the ones a request that computes its
whole prompt gets."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tandem.settings import DEMO_DRAFT, DEMO_DRAFTS, DEMO_TARGET
from tests.integration.stack import DEMO_HTTP, SharedStacks, Stack, generate, serve
from tests.integration.test_http_api import MODEL, metric_samples, value
from tests.integration.test_target_faults import child_pids

BLOCK = 16  # the demo stack's --block-size
# Long enough for several whole blocks, and unlike every other test's prompts, so that only this module's requests
# leave its blocks in the cache.
PROMPT = "".join(f"def prefix_cache_case_{index}(values):\n    return sorted(values)[{index}]\n" for index in range(12))


@pytest.fixture(scope="module")
def stack(stacks: SharedStacks) -> Stack:
    return stacks.get(DEMO_TARGET, DEMO_DRAFT, *DEMO_HTTP)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_repeated_prompt_is_served_from_the_cache_with_the_same_tokens(stack: Stack) -> None:
    options = {"prompt": PROMPT, "max_new_tokens": 24, "ignore_eos": True, "disable_speculation": True}
    salted = generate(stack.address, **options, cache_salt="computes every token")
    first = generate(stack.address, **options)
    again = generate(stack.address, **options)
    whole_blocks = (first.stats.prompt_tokens - 1) // BLOCK * BLOCK
    assert (salted.stats.cached_tokens, first.stats.cached_tokens) == (0, 0)
    assert again.stats.cached_tokens == whole_blocks > 0
    assert again.token_ids == first.token_ids == salted.token_ids
    seeded = {**options, "temperature": 0.8, "seed": 7, "disable_speculation": False}
    sampled = [generate(stack.address, **seeded, cache_salt=salt) for salt in ("computes every token", "")]
    # With speculation the last block found is computed again, for the replica (target_server.admission).
    assert sampled[1].stats.cached_tokens == whole_blocks - BLOCK and sampled[0].token_ids == sampled[1].token_ids


@pytest.mark.parametrize("draft", [DEMO_DRAFT, DEMO_DRAFTS["dflash"]], ids=["eagle3", "dflash"])
def test_a_replica_reuses_its_draft_context_where_the_target_skipped_it(stacks: SharedStacks, draft: object) -> None:
    stack = stacks.get(DEMO_TARGET, draft, *DEMO_HTTP)
    options = {"prompt": f"# drafted by {draft}\n{PROMPT}", "max_new_tokens": 48, "ignore_eos": True}
    before = metric_samples(stack)
    first = generate(stack.address, **options)
    again = generate(stack.address, **options)
    after = metric_samples(stack)
    # An EAGLE3 head's KV of a block depends on the token after it: the target computes the last block found again.
    reused = (first.stats.prompt_tokens - 1) // BLOCK * BLOCK - (BLOCK if draft == DEMO_DRAFT else 0)
    assert (first.stats.cached_tokens, again.stats.cached_tokens) == (0, reused)
    assert again.token_ids == first.token_ids
    counted = [
        value(after, name) - value(before, name)
        for name in ("tandem:draft_prefix_cache_queries_total", "tandem:draft_prefix_cache_hits_total")
    ]
    assert counted == [reused, reused]
    # Drafting from its whole context: a replica drafting blind would accept next to nothing.
    assert again.stats.accepted_tokens / again.stats.rounds >= 0.8 * first.stats.accepted_tokens / first.stats.rounds


def test_http_usage_counts_cached_tokens_and_salts_share_nothing(stack: Stack, client: openai.OpenAI) -> None:
    before = metric_samples(stack)
    options = {"model": MODEL, "prompt": PROMPT + "# salted\n", "max_tokens": 8, "temperature": 0}
    salted = {"disable_speculation": True, "ignore_eos": True, "cache_salt": "tenant-a"}
    first = client.completions.create(**options, extra_body=salted)  # type: ignore[call-overload]
    other = client.completions.create(**options, extra_body={**salted, "cache_salt": "tenant-b"})  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(  # type: ignore[call-overload]
            **options, extra_body=salted, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = chunks[-1].usage
    assert first.usage is not None and other.usage is not None and usage is not None
    cached = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert first.usage.prompt_tokens_details is not None and other.usage.prompt_tokens_details is not None
    assert (first.usage.prompt_tokens_details.cached_tokens, other.usage.prompt_tokens_details.cached_tokens) == (0, 0)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == cached > 0
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == first.choices[0].text
    after = metric_samples(stack)
    queries = value(after, "vllm:prefix_cache_queries_total") - value(before, "vllm:prefix_cache_queries_total")
    hits = value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (3 * first.usage.prompt_tokens, cached)


def test_a_cache_salt_that_is_not_a_string_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": 7})


def test_a_conversation_stays_on_the_replica_that_holds_its_context_and_survives_losing_it() -> None:
    """Later turns go where their draft context is; then that replica dies, and the target restarts empty: the
    tokens stay target-only's."""
    with serve(DEMO_TARGET, DEMO_DRAFT, "--draft-replicas", "2", *DEMO_HTTP) as stack:
        turns = [f"# conversation {index}\n{PROMPT}" for index in range(2)]
        with ThreadPoolExecutor(2) as pool:  # at once: least outstanding puts them on different replicas
            first = list(
                pool.map(lambda p: generate(stack.address, prompt=p, max_new_tokens=32, ignore_eos=True), turns)
            )
        before = metric_samples(stack)
        for turn, reply in zip(turns, first, strict=True):  # one after the other: each goes where its context is
            later = generate(stack.address, prompt=turn + reply.text + "\n# next\n", max_new_tokens=16, ignore_eos=True)
            assert later.stats.cached_tokens >= (reply.stats.prompt_tokens - 1) // BLOCK * BLOCK - BLOCK
        after = metric_samples(stack)
        queried, hits = (
            value(after, name) - value(before, name)
            for name in ("tandem:draft_prefix_cache_queries_total", "tandem:draft_prefix_cache_hits_total")
        )
        assert queried == hits > 0
        turn = turns[0] + first[0].text + "\n# after a failure\n"
        expected = generate(stack.address, prompt=turn, max_new_tokens=24, ignore_eos=True, disable_speculation=True)
        for service_name in ("draft", "target"):  # every replica's process, then the target's: serve restarts them
            for pid in child_pids(stack, service_name):
                os.kill(pid, signal.SIGKILL)
            again = generate(stack.address, prompt=turn, max_new_tokens=24, ignore_eos=True)
            assert again.token_ids == expected.token_ids, service_name
