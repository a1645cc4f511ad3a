"""OpenAI requests to GenerateRequest, refusals naming their field, response shapes and SSE framing, chat prompts."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from transformers import AutoTokenizer

from orchestrator.api.chat import chat_prompt_ids
from orchestrator.api.http_api import bearer_check
from orchestrator.api.openai_logprobs import LogprobShaper
from orchestrator.api.openai_protocol import DEFAULT_TEMPERATURE, ApiError, from_invalid, parse_chat, parse_completion
from orchestrator.api.openai_responses import ResponseShape, Usage, server_sent_event
from orchestrator.loop.validation import InvalidRequest
from tandem.sampling.logprobs import TokenLogprob
from tandem.settings import DEMO_CHAT_TEMPLATE, DEMO_TARGET

MODEL = "demo"


def refused(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, MODEL)
    return caught.value


def test_completion_fields_become_a_generate_request() -> None:
    body = {
        "model": MODEL,
        "prompt": "def f():",
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 3,
        "seed": 0,
        "stop": "\n\n",
        "stop_token_ids": [4, 5],
        "ignore_eos": True,
        "n": 1,
        "user": "someone",  # does not change the output: accepted and ignored
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_completion(body, MODEL)
    generate = parsed.generate
    assert (generate.prompt, generate.max_new_tokens, generate.temperature, generate.top_k) == ("def f():", 7, 0.0, 3)
    assert generate.top_p == pytest.approx(0.5)
    assert generate.HasField("seed") and generate.seed == 0
    assert list(generate.stop) == ["\n\n"] and list(generate.stop_token_ids) == [4, 5]
    assert generate.ignore_eos and not generate.disable_speculation
    assert (parsed.stream, parsed.include_usage, parsed.chat) == (True, True, False)


def test_unset_fields_take_openai_defaults() -> None:
    generate = parse_completion({"prompt": [5, 6, 7]}, MODEL).generate
    assert list(generate.input_ids) == [5, 6, 7] and not generate.prompt
    assert generate.temperature == DEFAULT_TEMPERATURE
    assert generate.max_new_tokens == 0  # the server's default
    assert not generate.HasField("seed")
    assert parse_completion({"prompt": ["one prompt"], "top_k": -1}, MODEL).generate.top_k == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"prompt": "x", "n": 3}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "logit_bias": [1]}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias[5]"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_bad_completion_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    error = refused(parse_completion, body)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(f"{param}: ")
    assert error.body()["error"]["param"] == param


def test_another_model_is_not_found() -> None:
    error = refused(parse_completion, {"model": "gpt-4", "prompt": "x"})
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")


def test_chat_messages_and_their_refusals() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_completion_tokens": 3, "logprobs": False}
    parsed = parse_chat(body, MODEL)
    assert parsed.messages == ({"role": "user", "content": "Hello, world"},)
    assert parsed.chat and parsed.generate.max_new_tokens == 3
    assert refused(parse_chat, {"messages": []}).param == "messages"
    assert refused(parse_chat, {"messages": [{"content": "x"}]}).param == "messages[0].role"
    # An image part stays in place for the chat template; its URL is read later (orchestrator.api.media).
    image = [{"type": "text", "text": "See "}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    parsed = parse_chat({"messages": [{"role": "user", "content": image}]}, MODEL)
    assert parsed.messages[0]["content"] == [{"type": "text", "text": "See "}, {"type": "image"}]
    assert [(part.url, part.where) for part in parsed.images] == [("data:x", "messages[0].content[1]")]
    audio = [{"type": "input_audio", "input_audio": {}}]
    error = refused(parse_chat, {"messages": [{"role": "user", "content": audio}]})
    assert error.param == "messages[0].content[0]"
    assert error.message.startswith("messages[0].content[0]: 'input_audio' parts are not served")
    nameless = [{"type": "image_url", "image_url": {}}]
    assert refused(parse_chat, {"messages": [{"role": "user", "content": nameless}]}).param.endswith("image_url")
    user = [{"role": "user", "content": "x"}]
    assert refused(parse_chat, {"messages": user, "logprobs": 1}).param == "logprobs"
    assert refused(parse_chat, {"messages": user, "top_logprobs": 2}).param == "top_logprobs"
    assert refused(parse_chat, {"messages": user, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    tools = {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}
    assert refused(parse_chat, tools).param == "tools[0].function"
    assert refused(parse_completion, {"prompt": "x", "tools": []}).param == "tools"


@pytest.mark.parametrize(
    ("message", "prompt_field", "param"),
    [
        ("max_new_tokens: 900 new tokens exceed the context", "prompt", "max_tokens"),
        ("input_ids[2]: 999 is outside the vocabulary", "prompt", "prompt[2]"),
        ("prompt: 600 tokens, the context holds 512", "messages", "messages"),
        ("stop[1]: must be a non-empty string", "prompt", "stop[1]"),
    ],
)
def test_scheduler_refusals_use_openai_field_names(message: str, prompt_field: str, param: str) -> None:
    error = from_invalid(InvalidRequest(message), prompt_field)
    assert (error.status, error.param) == (400, param)
    assert error.message == f"{param}: {message.split(': ', 1)[1]}"


def test_server_sent_events_and_chunks() -> None:
    shape = ResponseShape(chat=True, model_name=MODEL, request_id="abc-1", include_usage=True)
    event = server_sent_event(shape.chunk("é\n", None, first=True))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    chunk = json.loads(event[len(b"data: ") :])
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-abc-1"
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": "é\n"}
    assert chunk["usage"] is None
    assert shape.chunk("x", "stop")["choices"][0]["delta"] == {"content": "x"}
    usage = shape.usage_chunk(Usage(3, 4))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert usage["id"] == chunk["id"]
    plain = ResponseShape(chat=False, model_name=MODEL, request_id="abc-2")
    assert "usage" not in plain.chunk("x", None)
    whole = plain.full("text", "length", Usage(1, 2))
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "text"
    assert whole["id"] == "cmpl-abc-2" and whole["choices"][0]["logprobs"] is None


def test_logprob_and_min_tokens_fields() -> None:
    completion = parse_completion({"prompt": "x", "logprobs": 3, "min_tokens": 4}, MODEL).generate
    assert (completion.logprobs, completion.top_logprobs, completion.min_tokens) == (True, 3, 4)
    none = parse_completion({"prompt": "x"}, MODEL).generate
    assert (none.logprobs, none.top_logprobs, none.min_tokens) == (False, 0, 0)
    user = [{"role": "user", "content": "x"}]
    chat = parse_chat({"messages": user, "logprobs": True, "top_logprobs": 20}, MODEL).generate
    assert (chat.logprobs, chat.top_logprobs) == (True, 20)
    assert parse_chat({"messages": user, "logprobs": True}, MODEL).generate.top_logprobs == 0


def test_logprobs_in_both_shapes() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    first, second = (
        tokenizer.encode("def", add_special_tokens=False)[0],
        tokenizer.encode(" x", add_special_tokens=False)[0],
    )
    entries = [TokenLogprob(first, -0.5, ((first, -0.5), (second, -1.5))), TokenLogprob(second, -2.0, ())]
    texts = [tokenizer.decode([first]), tokenizer.decode([second])]
    completion = LogprobShaper(tokenizer, chat=False)
    assert completion.shape(entries[:1]) == {
        "tokens": texts[:1],
        "token_logprobs": [-0.5],
        "top_logprobs": [{texts[0]: -0.5, texts[1]: -1.5}],
        "text_offset": [0],
    }
    assert completion.shape(entries[1:])["text_offset"] == [len(texts[0])]  # a stream's offsets go on
    chat = LogprobShaper(tokenizer, chat=True).shape(entries)
    assert [item["token"] for item in chat["content"]] == texts
    assert chat["content"][0]["bytes"] == list(texts[0].encode())
    assert chat["content"][0]["top_logprobs"][1] == {
        "token": texts[1],
        "logprob": -1.5,
        "bytes": list(texts[1].encode()),
    }
    assert chat["content"][1]["top_logprobs"] == []


def test_chat_prompt_ids_render_the_template_or_refuse() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    messages = [{"role": "user", "content": "Parse it."}]
    with pytest.raises(ApiError, match="--chat-template") as caught:
        chat_prompt_ids(tokenizer, None, messages, max_characters=1000)
    assert caught.value.param == "messages"
    template = DEMO_CHAT_TEMPLATE.read_text()
    ids = chat_prompt_ids(tokenizer, template, messages, max_characters=1000)
    assert tokenizer.decode(ids) == "# user: Parse it.\n# assistant:\n"
    with pytest.raises(ApiError, match="characters"):
        chat_prompt_ids(tokenizer, template, messages, max_characters=5)


def test_bearer_check_answers_401_without_the_key() -> None:
    check = bearer_check("secret")
    check(make_mocked_request("GET", "/v1/models", headers={"Authorization": "Bearer secret"}))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        with pytest.raises(ApiError) as caught:
            check(make_mocked_request("GET", "/v1/models", headers=headers))
        assert caught.value.status == 401
        assert "secret" not in caught.value.message


def test_penalties_and_logit_bias_reach_the_request() -> None:
    body = {
        "prompt": "x",
        "presence_penalty": -0.5,
        "frequency_penalty": 1.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "11": 2.5},
    }
    generate = parse_completion(body, MODEL).generate
    assert (generate.presence_penalty, generate.frequency_penalty) == (-0.5, 1.5)
    assert generate.repetition_penalty == pytest.approx(1.2)
    assert dict(generate.logit_bias) == {7: -100.0, 11: 2.5}
