"""Resumable Generate through `tandem serve` on the demo pair: a request re-sent with the first tokens of its stream
as resume_token_ids sends exactly the rest of that stream, whatever its options (greedy, seeded sampling, penalties
with min_tokens, a grammar with logprobs, stop strings), its prompt and resumed tokens come from the target's prefix
cache, and `tandem generate` resumes on the next of its addresses."""

from __future__ import annotations

import socket
import subprocess

import grpc
import pytest

from tandem.settings import DEMO_DRAFT, DEMO_TARGET
from tandem.wire import common_pb2
from tests.integration.stack import DEMO_HTTP, SharedStacks, Stack, generate, tandem_command

PROMPT = "".join(f"def resumed_case_{index}(values):\n    return values[{index}]\n" for index in range(6))
CASES = {
    "greedy": {"max_new_tokens": 40, "ignore_eos": True},
    "seeded": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.8, "seed": 11},
    "penalties": {"max_new_tokens": 40, "presence_penalty": 0.5, "frequency_penalty": 0.4, "min_tokens": 30},
    "grammar": {
        "max_new_tokens": 40,
        "regex": "def [a-z_]{1,20}\\(values\\):\n    return values\\[[0-9]{1,3}\\]",
        "logprobs": True,
        "top_logprobs": 2,
    },
    "stop": {"max_new_tokens": 40, "ignore_eos": True, "stop": ["\n\n", "return values[7"]},
}


def flat(logprobs: list[common_pb2.TokenLogprob]) -> list[float]:
    """Each token's id, logprob and alternatives in one list."""
    return [
        value
        for entry in logprobs
        for value in (entry.token_id, entry.logprob, *(v for top in entry.top for v in (top.token_id, top.logprob)))
    ]


@pytest.fixture(scope="module")
def stack(stacks: SharedStacks) -> Stack:
    return stacks.get(DEMO_TARGET, DEMO_DRAFT, *DEMO_HTTP)


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_sends_the_rest_of_its_stream(stack: Stack, case: str) -> None:
    fields = {"prompt": PROMPT, **CASES[case]}
    whole = generate(stack.address, **fields)
    assert len(whole.token_ids) >= 4, whole
    for cut in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        rest = generate(stack.address, **fields, resume_token_ids=whole.token_ids[:cut])
        assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids, (case, cut)
        assert (rest.finish_reason, rest.stats.completion_tokens) == (whole.finish_reason, len(whole.token_ids))
        # The same tokens and alternatives; the values to float noise (a prefill's rows, not a decode's).
        assert flat(rest.logprobs) == pytest.approx(flat(whole.logprobs[cut:]), abs=1e-4)
    # The prompt and the resumed tokens are the blocks the first request left in the target's prefix cache.
    assert rest.stats.cached_tokens >= whole.stats.prompt_tokens - 16


def test_a_resume_no_stream_could_have_sent_is_refused(stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack.address, prompt=PROMPT, max_new_tokens=2, resume_token_ids=[5, 6, 7])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_token_ids: 3 tokens, more than the request's max_new_tokens = 2" in (refused.value.details() or "")
    whole = generate(stack.address, prompt=PROMPT, max_new_tokens=3, ignore_eos=True)
    ended = generate(stack.address, prompt=PROMPT, max_new_tokens=3, resume_token_ids=whole.token_ids)
    assert (ended.token_ids, ended.finish_reason, ended.stats.completion_tokens) == ([], "length", 3)


def test_tandem_generate_resumes_on_its_next_address(stack: Stack) -> None:
    with socket.socket() as closed:  # a port nothing listens on: the first attempt is refused
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
    arguments = ["generate", "def resumed(values):", "--max-new-tokens", "16", "--ignore-eos"]
    direct = subprocess.run(tandem_command(*arguments, "--address", stack.address), capture_output=True, text=True)
    resumed = subprocess.run(
        tandem_command(*arguments, "--address", dead, "--address", stack.address), capture_output=True, text=True
    )
    assert direct.returncode == resumed.returncode == 0, (direct.stderr, resumed.stderr)
    assert f"resuming after 0 tokens at {stack.address} (UNAVAILABLE" in resumed.stderr
    assert resumed.stdout.split("\n[finish_reason")[0] == direct.stdout.split("\n[finish_reason")[0]
    assert "completion_tokens=16" in resumed.stdout
