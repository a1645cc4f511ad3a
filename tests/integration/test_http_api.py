"""The OpenAI-compatible HTTP API and /metrics of `tandem serve` on the bundled demo, through the official client."""

from __future__ import annotations

import itertools
import json
import re
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.settings import DEMO_DRAFT, DEMO_TARGET
from tests.integration.stack import DEMO_HTTP, SharedStacks, Stack, generate
from tests.integration.test_logprobs import reference_logprobs

PROMPT = "def parse(text):"
MODEL = DEMO_TARGET.name  # the served model's name defaults to the target directory's
WAIT_S = 60.0


@pytest.fixture(scope="module")
def stack(stacks: SharedStacks) -> Stack:
    return stacks.get(DEMO_TARGET, DEMO_DRAFT, *DEMO_HTTP)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    assert stack.http_url.startswith("http://"), stack.http_url
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric_samples(stack: Stack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels without model_name)."""
    with urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_greedy_text_is_the_same_over_grpc_and_http(stack: Stack, client: openai.OpenAI) -> None:
    over_grpc = generate(stack.address, prompt=PROMPT, max_new_tokens=32, ignore_eos=True)
    options = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    completion = client.completions.create(**options)  # type: ignore[call-overload]
    assert completion.choices[0].text == over_grpc.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 32
    assert completion.usage.prompt_tokens == over_grpc.stats.prompt_tokens
    assert completion.usage.total_tokens == 32 + over_grpc.stats.prompt_tokens

    chunks = list(client.completions.create(**options, stream=True))  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in chunks) == over_grpc.text
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert all(chunk.usage is None for chunk in chunks)  # no usage chunk unless asked for

    with_usage = list(
        client.completions.create(**options, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage is not None
    assert with_usage[-1].usage.model_dump() == completion.usage.model_dump()
    assert "".join(chunk.choices[0].text for chunk in with_usage[:-1]) == over_grpc.text

    # On the wire: server-sent events, each `data: {json}`, the last one `data: [DONE]`.
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    raw = urllib.request.Request(f"{stack.http_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(raw, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") for event in events[:-2])


def test_chat_streamed_and_not(stack: Stack, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "Parse a header."}]
    options = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(**options)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage is not None and 0 < whole.usage.completion_tokens <= 16

    chunks = list(
        client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    streamed, unstreamed = usage_chunk.usage.model_dump(), whole.usage.model_dump()
    cached = streamed.pop("prompt_tokens_details")["cached_tokens"]
    unstreamed.pop("prompt_tokens_details")
    # The same prompt again: its whole blocks come from the prefix cache (the last prompt token is computed), but for
    # the last one found, computed again for the draft replica its rows stream to (target_server.admission).
    assert streamed == unstreamed and cached == max(0, (whole.usage.prompt_tokens - 1) // 16 * 16 - 16)
    content = chunks[:-1]
    assert content[0].choices[0].delta.role == "assistant"
    assert all(chunk.usage is None for chunk in content)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in content) == choice.message.content
    assert content[-1].choices[0].finish_reason == choice.finish_reason


def test_stop_token_ids_and_seed_zero(stack: Stack, client: openai.OpenAI) -> None:
    reference = generate(stack.address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True)
    stop_at = 5
    stop_token = reference.token_ids[stop_at]
    first = reference.token_ids.index(stop_token)  # the first time it appears
    stopped = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_token]},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == first + 1

    sampled = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=0).choices[0].text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]
    over_grpc = generate(stack.address, prompt=PROMPT, max_new_tokens=24, temperature=1.0, seed=0)
    assert over_grpc.text == sampled[0]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 2}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"top_logprobs": 2}}, "top_logprobs"),
        ({"max_tokens": 8, "extra_body": {"min_tokens": 9}}, "min_tokens"),
        ({"extra_headers": {"X-Request-Id": "has space"}}, "x-request-id"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids[0]"),
    ],
)
def test_bad_input_is_400_naming_the_field(client: openai.OpenAI, fields: dict[str, object], param: str) -> None:
    headers = {"X-Request-Id": f"bad-{param}"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, **{"extra_headers": headers, **fields})  # type: ignore[call-overload]
    error = caught.value
    assert error.status_code == 400
    assert isinstance(error.body, dict)
    assert error.body["param"] == param
    assert error.body["message"].startswith(f"{param}: "), error.body
    echoed = error.response.headers["x-request-id"]
    if param == "x-request-id":
        assert re.fullmatch("[0-9a-f]{32}", echoed)  # an id that fails the check is not echoed: a new one is made
    else:
        assert echoed == f"bad-{param}"


def test_unknown_model_and_route(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(
            model="gpt-4", prompt=PROMPT, max_tokens=4, extra_headers={"X-Request-Id": "trace-404"}
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "model"
    assert caught.value.body["code"] == "model_not_found"
    assert caught.value.response.headers["x-request-id"] == "trace-404"
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{stack.http_url}/v1/nothing-here", timeout=30)
    assert missing.value.code == 404
    assert json.loads(missing.value.read())["error"]["type"] == "not_found_error"
    assert re.fullmatch("[0-9a-f]{32}", missing.value.headers["X-Request-Id"])
    assert [model.id for model in client.models.list()] == [MODEL]
    with urllib.request.urlopen(f"{stack.http_url}/health", timeout=30) as response:
        assert response.status == 200


def test_metrics_count_what_requests_report(stack: Stack, client: openai.OpenAI) -> None:
    before = metric_samples(stack)
    prompts = ["import os\n", "class Parser:", "def main():"]
    completions = [generate(stack.address, prompt=prompt, max_new_tokens=20, ignore_eos=True) for prompt in prompts]
    over_http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    after = metric_samples(stack)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    stats = [completion.stats for completion in completions]
    assert over_http.usage is not None
    assert delta("vllm:prompt_tokens_total") == sum(s.prompt_tokens for s in stats) + over_http.usage.prompt_tokens
    generated = sum(s.completion_tokens for s in stats) + over_http.usage.completion_tokens
    assert delta("vllm:generation_tokens_total") == generated
    finished_reason = over_http.choices[0].finish_reason
    assert delta("vllm:request_success_total", finished_reason="length") == 3 + (finished_reason == "length")
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:request_queue_time_seconds_count") == 4

    assert delta("vllm:spec_decode_num_draft_tokens_total") >= sum(s.draft_tokens for s in stats) > 0
    assert delta("vllm:spec_decode_num_accepted_tokens_total") >= sum(s.accepted_tokens for s in stats) > 0

    # One request alone: the speculative counters move by exactly its own stats.
    alone = generate(stack.address, prompt=PROMPT, max_new_tokens=20, ignore_eos=True).stats
    before, after = after, metric_samples(stack)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == alone.draft_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == alone.accepted_tokens
    per_position = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(5)]
    assert per_position == list(alone.accepted_per_position) + [0] * (5 - len(alone.accepted_per_position))
    assert 0 < delta("vllm:spec_decode_num_drafts_total") <= alone.rounds
    assert delta("tandem:rounds_total") == alone.rounds
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert value(after, "tandem:draft_replicas", state="serving") == 1
    # Every round that drafts asks its replica once (a round near the end may draft nothing and ask nothing).
    assert 0 < delta("tandem:propose_seconds_count", replica="draft-0") <= alone.rounds
    assert value(after, "tandem:k_in_use") == 5  # --speculative-num-steps' default; k is fixed in these tests


def test_a_client_that_disconnects_cancels_its_request(stack: Stack, client: openai.OpenAI) -> None:
    before = value(metric_samples(stack), "vllm:request_success_total", finished_reason="abort")
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = metric_samples(stack)
        aborted = value(samples, "vllm:request_success_total", finished_reason="abort") - before
        if aborted == 1 and value(samples, "vllm:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, f"the request was not cancelled: {samples}"
        time.sleep(0.2)
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0


def test_logprobs_of_accepted_drafts_equal_transformers_over_grpc(stack: Stack) -> None:
    completion = generate(
        stack.address, prompt=PROMPT, max_new_tokens=32, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    assert completion.stats.accepted_tokens > 0  # the demo pair accepts many drafts: most tokens came from them
    expected = reference_logprobs(DEMO_TARGET, PROMPT, completion.token_ids)
    assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
    for row, entry in zip(expected, completion.logprobs, strict=True):
        assert abs(entry.logprob - float(row[entry.token_id])) <= 1e-4
        assert [top.token_id for top in entry.top] == row.topk(2).indices.tolist()
        assert [top.logprob for top in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)


def test_logprobs_on_completions_and_chat_streamed_and_not(stack: Stack, client: openai.OpenAI) -> None:
    over_grpc = generate(
        stack.address, prompt=PROMPT, max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    logprobs = [entry.logprob for entry in over_grpc.logprobs]
    assert all(value <= 0.0 for value in logprobs)
    options = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 3}
    options["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**options)  # type: ignore[call-overload]
    shaped = whole.choices[0].logprobs
    assert shaped is not None and shaped.token_logprobs is not None and shaped.tokens is not None
    assert shaped.token_logprobs == pytest.approx(logprobs, abs=1e-6)
    assert "".join(shaped.tokens) == whole.choices[0].text == over_grpc.text
    assert shaped.text_offset == [sum(len(token) for token in shaped.tokens[:index]) for index in range(16)]
    assert shaped.top_logprobs is not None and all(len(top) <= 3 for top in shaped.top_logprobs)
    assert [max(top.values()) for top in shaped.top_logprobs] == pytest.approx(logprobs, abs=1e-6)

    chunks = list(client.completions.create(**options, stream=True))  # type: ignore[call-overload]
    streamed = [
        value for chunk in chunks if chunk.choices[0].logprobs for value in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(logprobs, abs=1e-6)
    offsets = [
        value for chunk in chunks if chunk.choices[0].logprobs for value in chunk.choices[0].logprobs.text_offset
    ]
    assert offsets == shaped.text_offset

    messages = [{"role": "user", "content": "Parse a header."}]
    chat_options = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    chat_options |= {"logprobs": True, "top_logprobs": 2}
    chat = client.chat.completions.create(**chat_options)  # type: ignore[call-overload]
    content = chat.choices[0].logprobs.content
    assert content is not None and len(content) == chat.usage.completion_tokens
    assert "".join(item.token for item in content) == chat.choices[0].message.content
    for item in content:
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert item.logprob <= 0.0
    chat_chunks = list(client.chat.completions.create(**chat_options, stream=True))  # type: ignore[call-overload]
    streamed_chat = [
        item for chunk in chat_chunks if chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content
    ]
    assert [(item.token, item.logprob) for item in streamed_chat] == [(item.token, item.logprob) for item in content]

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**chat_options, "top_logprobs": 21})  # type: ignore[call-overload]
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "top_logprobs"


def test_min_tokens_holds_off_eos_and_stop_token_ids(stack: Stack, client: openai.OpenAI) -> None:
    first = generate(stack.address, prompt=PROMPT, max_new_tokens=1).token_ids[0]
    extra = {"stop_token_ids": [first]}  # would end the request at its first token; EOS is not ignored either
    ended = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    held = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={**extra, "min_tokens": 8}
    )
    assert held.usage is not None and held.usage.completion_tokens >= 8
    over_grpc = generate(stack.address, prompt=PROMPT, max_new_tokens=24, min_tokens=8, stop_token_ids=[first])
    assert over_grpc.text == held.choices[0].text
    assert first not in over_grpc.token_ids[:8]
    target_only = generate(
        stack.address, prompt=PROMPT, max_new_tokens=24, min_tokens=8, stop_token_ids=[first], disable_speculation=True
    )
    assert target_only.token_ids == over_grpc.token_ids


def test_the_client_request_id_is_echoed(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "cmpl-trace-42"
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        stream=True,
        extra_headers={"X-Request-Id": "trace-43"},
    )
    assert chat.headers["x-request-id"] == "trace-43"
    assert {chunk.id for chunk in chat.parse()} == {"chatcmpl-trace-43"}
    unnamed = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert unnamed.parse().id == "cmpl-" + unnamed.headers["x-request-id"]


def test_after_a_stop_string_token_ids_end_with_the_last_token_before_it(stack: Stack, client: openai.OpenAI) -> None:
    full = generate(stack.address, prompt=PROMPT, max_new_tokens=32, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    starts = [len(tokenizer.decode(full.token_ids[:index])) for index in range(len(full.token_ids))]
    assert tokenizer.decode(full.token_ids) == full.text
    # A stop string that starts inside a token's text when there is one, so that the cut is not at a boundary.
    cut = next((start + 1 for start, end in itertools.pairwise(starts) if start >= 4 and end - start > 1), 4)
    stop = full.text[cut : cut + 3]
    cut = full.text.index(stop)
    stopped = generate(stack.address, prompt=PROMPT, max_new_tokens=32, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    kept = [token for token, start in zip(full.token_ids, starts, strict=True) if start < cut]
    assert stopped.token_ids == kept
    assert stopped.stats.completion_tokens == len(kept)
    over_http = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert over_http.choices[0].text == stopped.text
    assert over_http.choices[0].finish_reason == "stop"
    assert over_http.usage is not None and over_http.usage.completion_tokens == len(kept)


PENALIZED = [
    {"presence_penalty": 1.0, "frequency_penalty": 0.8},
    {"frequency_penalty": -1.5},
    {"repetition_penalty": 1.4},  # vLLM's extra parameter (extra_body for the openai client)
]


@pytest.mark.parametrize("options", PENALIZED)
def test_penalties_change_greedy_output_and_speculation_does_not(client: openai.OpenAI, options: dict) -> None:
    """Each verified row counts its own draft path (tandem.sampling.processing), so the drafts the EAGLE3 head
    proposes (chains of 5) cannot change what greedy decoding with penalties gives."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    plain = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    speculative = client.completions.create(**base, extra_body={"ignore_eos": True, **options}).choices[0].text
    target_only = (
        client.completions.create(**base, extra_body={"ignore_eos": True, "disable_speculation": True, **options})
        .choices[0]
        .text
    )
    assert speculative == target_only != plain


def test_logit_bias_bans_the_favourite_tokens_with_and_without_speculation(stack: Stack, client: openai.OpenAI) -> None:
    first = generate(stack.address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True).token_ids
    banned = {str(token): -100 for token in set(first[:6])}
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logit_bias": banned}
    speculative = client.completions.create(**base, extra_body={"ignore_eos": True})
    target_only = client.completions.create(**base, extra_body={"ignore_eos": True, "disable_speculation": True})
    assert speculative.choices[0].text == target_only.choices[0].text
    banned_ids = generate(
        stack.address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True, logit_bias={int(t): -100 for t in banned}
    ).token_ids
    assert not set(banned_ids) & set(first[:6])


def test_drafts_are_shaped_by_the_bias_so_they_are_accepted(stack: Stack) -> None:
    """The draft replica shapes its logits by the request's options as the target does (draft_server.shaping): a
    token lifted far above the rest is what the target chooses everywhere, and what every draft proposes."""
    lifted = generate(stack.address, prompt=PROMPT, max_new_tokens=4, ignore_eos=True).token_ids[3]
    completion = generate(stack.address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True, logit_bias={lifted: 100})
    assert set(completion.token_ids) == {lifted}
    assert completion.stats.draft_tokens > 0
    assert completion.stats.accepted_tokens == completion.stats.draft_tokens


def test_repetition_penalty_is_transformers_generate(stack: Stack) -> None:
    completion = generate(stack.address, prompt=PROMPT, max_new_tokens=40, ignore_eos=True, repetition_penalty=1.3)
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32).eval()
    prompt_ids = torch.tensor([tokenizer(PROMPT).input_ids])
    with torch.no_grad():
        output = model.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=False,
            max_new_tokens=40,
            min_new_tokens=40,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
            repetition_penalty=1.3,
        )
    assert completion.token_ids == output[0, prompt_ids.shape[1] :].tolist()
    assert completion.stats.accepted_tokens > 0  # the drafts were verified under the penalty, not skipped


def test_penalty_and_bias_values_out_of_range_are_400(client: openai.OpenAI) -> None:
    for options, param in (
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": -2}}, "repetition_penalty"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **options)
        assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["parser", "lexer", "other"]},
    },
    "required": ["name", "count", "ok", "kind"],
    "additionalProperties": False,
}


def json_schema_chat(client: openai.OpenAI, disable_speculation: bool) -> tuple[str, str]:
    """A greedy chat answer constrained by BOUNDED_SCHEMA: its content and finish reason."""
    response_format = {"type": "json_schema", "json_schema": {"name": "tool", "schema": BOUNDED_SCHEMA, "strict": True}}
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe parse() as JSON."}],
        max_tokens=96,
        temperature=0,
        response_format=response_format,  # type: ignore[arg-type]
        extra_body={"disable_speculation": disable_speculation},
    )
    choice = completion.choices[0]
    return choice.message.content or "", choice.finish_reason


def test_json_schema_output_validates_and_speculation_does_not_change_it(client: openai.OpenAI) -> None:
    texts = [json_schema_chat(client, disable) for disable in (False, True)]
    assert texts[0] == texts[1] and texts[0][1] == "stop", texts
    jsonschema.validate(json.loads(texts[0][0]), BOUNDED_SCHEMA)


def structured_completion(
    client: openai.OpenAI, extra: dict, disable_speculation: bool, max_tokens: int
) -> tuple[str, str]:
    """A greedy raw completion of PROMPT with structured-output fields `extra`: its text and finish reason."""
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={**extra, "disable_speculation": disable_speculation},
    )
    return completion.choices[0].text, completion.choices[0].finish_reason


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no", "maybe not"]}, lambda text: text in ("yes", "no", "maybe not")),
        ({"guided_regex": "[a-z]{3,8}\\([a-z]{0,5}\\)"}, lambda text: re.fullmatch(r"[a-z]{3,8}\([a-z]{0,5}\)", text)),
        ({"response_format": {"type": "json_object"}}, lambda text: isinstance(json.loads(text), dict)),
    ],
)
def test_raw_completions_follow_vllms_structured_fields(client: openai.OpenAI, extra: dict, check: object) -> None:
    texts = [structured_completion(client, extra, disable, max_tokens=64) for disable in (False, True)]
    assert texts[0] == texts[1]
    text, finish_reason = texts[0]
    if finish_reason == "stop" or "response_format" not in extra:  # an object may still be open at max_tokens
        assert check(text), text  # type: ignore[operator]


def test_a_schema_that_does_not_compile_is_400_naming_response_format(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},  # type: ignore[arg-type]
        )
    body = caught.value.body
    assert body["param"] == "response_format" and "nonsense" in body["message"], body  # type: ignore[index]
