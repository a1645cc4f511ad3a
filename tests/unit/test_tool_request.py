"""A chat's tools checked as OpenAI's API defines them: each refusal is 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.api.openai_protocol import ApiError, parse_chat

USER = [{"role": "user", "content": "x"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "today's weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def refused(body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": USER, **body}, "demo")
    assert caught.value.status == 400
    assert caught.value.message.startswith(f"{caught.value.param}: ")
    return caught.value


def test_tools_and_choices_are_read() -> None:
    auto = parse_chat({"messages": USER, "tools": [WEATHER]}, "demo").tools
    assert auto is not None and auto.choice == "auto" and auto.parallel and not auto.forced
    named = {"type": "function", "function": {"name": "weather"}}
    forced = parse_chat(
        {"messages": USER, "tools": [WEATHER], "tool_choice": named, "parallel_tool_calls": False}, "demo"
    ).tools
    assert forced is not None and forced.choice == "named" and forced.named == "weather" and not forced.parallel
    assert forced.forced and forced.tools[0]["function"]["parameters"] == WEATHER["function"]["parameters"]
    bare = {"type": "function", "function": {"name": "now"}}
    required = parse_chat({"messages": USER, "tools": [bare], "tool_choice": "required"}, "demo").tools
    assert required is not None and required.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    none = parse_chat({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}, "demo").tools
    assert none is not None and not none.parsed
    assert parse_chat({"messages": USER, "tool_choice": "none"}, "demo").tools is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {"weather": {}}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
            "tools[0].function.description",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "news"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [WEATHER], "guided_regex": "a+"}, "regex"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    assert refused(body).param == param


def test_unknown_named_function_says_which_exist() -> None:
    error = refused({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "news"}}})
    assert "'news'" in error.message and "weather" in error.message


def test_tool_choice_none_may_come_with_structured_output() -> None:
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "none", "response_format": {"type": "json_object"}}
    assert parse_chat(body, "demo").generate.json_object


def test_tool_messages_are_accepted() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    parsed = parse_chat({"messages": messages, "tools": [WEATHER]}, "demo")
    assert parsed.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert parsed.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "sunny"}, "messages[1].tool_call_id"),
        ({"role": "assistant", "tool_calls": {}}, "messages[1].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[1].tool_calls[0].function",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_messages_are_refused(message: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [*USER, message]}, "demo")
    assert caught.value.param == param
