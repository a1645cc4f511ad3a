"""Tool calls on /v1/chat/completions of `tandem serve` on the bundled demo, through the official client.

The demo's template writes Hermes-style calls, which its model never learnt: a forced tool_choice (a named function,
or required) makes it call through the grammar, and the arguments validate against the function's parameters, the
same with and without speculation, streamed and not.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tandem.settings import DEMO_DRAFT, DEMO_TARGET
from tests.integration.stack import DEMO_HTTP, SharedStacks, Stack

MODEL = DEMO_TARGET.name
READ_LINES = {
    "type": "object",
    "properties": {
        "path": {"enum": ["parse.py", "lexer.py"]},
        "line": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["path", "line"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "read_lines", "description": "Read a file.", "parameters": READ_LINES}},
    {"type": "function", "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "Where is parse() defined?"}]
NAMED = {"type": "function", "function": {"name": "read_lines"}}


@pytest.fixture(scope="module")
def client(stacks: SharedStacks) -> openai.OpenAI:
    return _client(stacks.get(DEMO_TARGET, DEMO_DRAFT, *DEMO_HTTP))


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def calls_of(client: openai.OpenAI, stream: bool, **options: Any) -> tuple[list[tuple[str, str]], str, str | None]:
    """(name, arguments) of each call, the finish reason and the content, streamed or not."""
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **options}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []]
        assert all(call.type == "function" and call.id.startswith("call_") for call in choice.message.tool_calls or [])
        return calls, choice.finish_reason, choice.message.content
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content, finish_reason = [], ""
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in names and call.function is not None and call.function.name
                names[call.index] = call.function.name
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")  # type: ignore[union-attr]
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return [(names[index], arguments[index]) for index in sorted(names)], finish_reason, "".join(content) or None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_function_is_called_with_valid_arguments_with_and_without_speculation(
    client: openai.OpenAI, stream: bool
) -> None:
    answers = [
        calls_of(client, stream, tool_choice=NAMED, extra_body={"disable_speculation": disable})
        for disable in (False, True)
    ]
    assert answers[0] == answers[1]
    calls, finish_reason, content = answers[0]
    assert finish_reason == "tool_calls" and not content
    assert [name for name, _ in calls] == ["read_lines"]
    jsonschema.validate(json.loads(calls[0][1]), READ_LINES)


def test_required_calls_one_of_the_tools_the_same_streamed_and_not(client: openai.OpenAI) -> None:
    answers = [
        calls_of(client, stream, tool_choice="required", parallel_tool_calls=False, extra_body=extra)
        for stream, extra in ((False, {}), (True, {}), (False, {"disable_speculation": True}))
    ]
    assert answers[0] == answers[1] == answers[2]
    calls, finish_reason, _ = answers[0]
    assert finish_reason == "tool_calls" and len(calls) == 1
    name, arguments = calls[0]
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    jsonschema.validate(json.loads(arguments), parameters[name])


def test_an_unknown_function_is_400_naming_tool_choice(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "delete_files"}},
        )
    body = caught.value.body
    assert body["param"] == "tool_choice" and "delete_files" in body["message"], body  # type: ignore[index]


def test_a_tool_result_follows_the_call(client: openai.OpenAI) -> None:
    calls, _, _ = calls_of(client, False, tool_choice=NAMED)
    name, arguments = calls[0]
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "def parse(text):"},
    ]
    auto = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    choice = auto.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert auto.usage is not None and auto.usage.completion_tokens > 0
    again = calls_of(client, False, messages=history, tool_choice=NAMED)
    assert again[1] == "tool_calls"
    jsonschema.validate(json.loads(again[0][0][1]), READ_LINES)
