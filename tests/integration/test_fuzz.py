"""Property-based fuzzing of the public Generate RPC on a real `tandem serve` with a small KV pool: whatever the
fields hold, a request completes or is refused with INVALID_ARGUMENT or RESOURCE_EXHAUSTED (never UNKNOWN,
UNAVAILABLE or INTERNAL), and afterwards the target and the draft hold no request and no KV block.

Bounded: a fixed number of examples, derandomized so that CI runs the same ones every time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.stack import Stack, generate, serve, service_addresses
from tests.integration.test_serving import wait_until_idle

VOCAB_SIZE = 320  # the tiny target's (tests.helpers.checkpoints)
ACCEPTED_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def stack(llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    options = ["--speculative-num-steps", "3", "--kv-blocks", "24", "--block-size", "8", "--max-waiting", "4"]
    with serve(llama_target, random_draft, *options) as running:
        yield running


def floats() -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(width=32, allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, 1e-40, 1e-30, 0.5, 1.0, 2.0, 1e30, -1.0]),
    )


requests = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.text(max_size=64),
        "input_ids": st.lists(st.integers(-3, VOCAB_SIZE + 3), max_size=24),
        "max_new_tokens": st.integers(-3, 24),
        "temperature": floats(),
        "top_p": floats(),
        "top_k": st.integers(-3, VOCAB_SIZE + 10),
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(max_size=300), max_size=20),
        "ignore_eos": st.booleans(),
        "disable_speculation": st.booleans(),
        "stop_token_ids": st.lists(st.integers(-3, VOCAB_SIZE + 3), max_size=4),
    },
)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(fields=requests)
def test_any_request_completes_or_is_refused_cleanly(stack: Stack, fields: dict[str, object]) -> None:
    try:
        completion = generate(stack.address, **fields)
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]
        assert code in ACCEPTED_REFUSALS, f"{code}: {error.details()} for {fields}"  # type: ignore[attr-defined]
        assert error.details()  # type: ignore[attr-defined]
        return
    assert completion.finish_reason in {"length", "stop", "eos"}


def test_after_the_fuzzing_nothing_is_held(stack: Stack) -> None:
    target, draft = wait_until_idle(service_addresses(stack.log))
    assert (target.running_requests, target.kv_blocks_free) == (0, target.kv_blocks_total)
    assert (draft.running_requests, draft.kv_blocks_free) == (0, draft.kv_blocks_total)
