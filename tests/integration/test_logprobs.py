"""Logprobs over gRPC equal transformers' log_softmax of the same checkpoint's logits, for tokens committed with and
without drafts; the client's request id comes back in the response metadata."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import Completion, SharedStacks, generate

PROMPT = "def fibonacci(n):"
TOP = 5
TOLERANCE = 1e-4


def reference_logprobs(model_dir: Path, prompt: str, new_tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax for each new token's row, [len(new_tokens), vocab], float32."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt_ids, *new_tokens]])).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(new_tokens)]  # row i predicts new token i
    return torch.log_softmax(rows, dim=-1)


def check_against(expected: torch.Tensor, completion: Completion) -> None:
    assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
    for row, entry in zip(expected, completion.logprobs, strict=True):
        assert abs(entry.logprob - float(row[entry.token_id])) <= TOLERANCE
        assert len(entry.top) == TOP
        assert entry.top[0].token_id == entry.token_id  # greedy: the chosen token is the row's best
        best = row.topk(TOP)
        # Ties in the tail of a random model may order differently: compare values, and each id's own value.
        assert [top.logprob for top in entry.top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        for top in entry.top:
            assert abs(top.logprob - float(row[top.token_id])) <= TOLERANCE


def logprob_request(**fields: object) -> dict[str, object]:
    return {"prompt": PROMPT, "max_new_tokens": 16, "ignore_eos": True, "logprobs": True, "top_logprobs": TOP, **fields}


def test_logprobs_equal_transformers_with_and_without_drafts(
    llama_target: Path, random_draft: Path, stacks: SharedStacks
) -> None:
    stack = stacks.get(llama_target, random_draft, "--speculative-num-steps", "4")
    speculative = generate(stack.address, **logprob_request())
    target_only = generate(stack.address, **logprob_request(disable_speculation=True))
    plain = generate(stack.address, prompt=PROMPT, max_new_tokens=4, ignore_eos=True)
    with grpc.insecure_channel(stack.address, options=channel_options()) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
        request = orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=2, top_logprobs=3)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("top_logprobs: 3 needs logprobs")
        named = orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=2)
        call = stub.Generate(named, timeout=60, metadata=(("x-request-id", "client-7"),))
        assert [response.finish_reason for response in call][-1] == "length"
        assert dict(call.initial_metadata())["x-request-id"] == "client-7"
    assert speculative.token_ids == target_only.token_ids
    assert speculative.stats.draft_tokens > 0
    assert plain.logprobs == []
    expected = reference_logprobs(llama_target, PROMPT, speculative.token_ids)
    check_against(expected, speculative)
    check_against(expected, target_only)
    assert any("client id client-7" in line for line in stack.log)
