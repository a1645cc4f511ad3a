"""A reply read into content and tool calls as the HTTP API answers it: whole, streamed chunk by chunk, and decoded
again from token ids when the format's markers are special tokens of the tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from orchestrator.api.openai_protocol import ApiError
from orchestrator.api.openai_responses import ResponseShape, Usage
from orchestrator.api.tool_formats import HERMES, KIMI_K2
from orchestrator.api.tool_output import ChatTools, ToolReply
from orchestrator.api.tool_request import ToolRequest
from orchestrator.api.tool_stream import ToolCallStream
from orchestrator.loop.output import Output
from tandem.settings import DEMO_TARGET
from tandem.wire import orchestrator_pb2

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


def output(text: str, finish_reason: str = "", token_ids: list[int] | None = None) -> Output:
    return Output(token_ids or [], text, finish_reason, None, 3, 5)


def test_the_whole_answer_has_tool_calls_and_null_content() -> None:
    reply = ToolReply(ToolCallStream(HERMES))
    pieces = reply.pieces(output(CALL[:20])) + reply.pieces(output(CALL[20:], "eos"))
    response = reply.full(ResponseShape(True, "demo", "id"), pieces, "stop", Usage(3, 5), None)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}


def test_a_reply_cut_by_max_tokens_keeps_length() -> None:
    reply = ToolReply(ToolCallStream(HERMES))
    pieces = reply.pieces(output("So: " + CALL[:30], "length"))
    response = reply.full(ResponseShape(True, "demo", "id"), pieces, "length", Usage(3, 5), None)
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["choices"][0]["message"] == {"role": "assistant", "content": "So: " + CALL[:30]}


def test_chunks_stream_content_then_each_call_in_two_deltas() -> None:
    shape = ResponseShape(True, "demo", "id")
    reply = ToolReply(ToolCallStream(HERMES))
    first = reply.chunks(shape, output("Sure. <tool"), None, True, None)
    assert [chunk["choices"][0]["delta"] for chunk in first] == [{"role": "assistant", "content": "Sure. "}]
    last = reply.chunks(shape, output(CALL[len("<tool") :], "eos"), "stop", False, {"content": []})
    deltas = [chunk["choices"][0]["delta"] for chunk in last]
    opening, arguments = deltas
    [call] = opening["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": ""}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}
    assert last[0]["choices"][0]["logprobs"] == {"content": []}
    assert [chunk["choices"][0]["finish_reason"] for chunk in last] == [None, "tool_calls"]


def test_special_token_markers_are_decoded_from_the_token_ids() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    tokenizer.add_special_tokens({"additional_special_tokens": [m for m in KIMI_K2.markers if m.startswith("<|")]})
    template = "{{ '<|tool_calls_section_begin|>' }}"
    tools = ChatTools(tokenizer, template)
    assert tools.format is KIMI_K2 and len(tools.special_ids) == 5
    request = ToolRequest((WEATHER,), "auto")
    prompt = tokenizer.encode("# user: hi\n", add_special_tokens=False)
    reply = tools.reply(request, prompt, stop=["STOP"])
    assert reply is not None
    text = (
        "Looking.<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<|tool_call_begin|>" not in plain  # what the request's own text holds
    pieces: list[Any] = []
    for start in range(0, len(ids), 3):
        done = start + 3 >= len(ids)
        pieces += reply.pieces(output(plain if start == 0 else "", "eos" if done else "", ids[start : start + 3]))
    assert "".join(piece for piece in pieces if isinstance(piece, str)) == "Looking."
    [call] = reply.stream.calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("functions.weather:0", "weather", {"city": "Oslo"})


def test_a_forced_choice_gets_its_grammar_and_none_is_not_read() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    tools = ChatTools(tokenizer, "{{ '<tool_call>' }}")
    generate = orchestrator_pb2.GenerateRequest()
    tools.prepare(ToolRequest((WEATHER,), "named", "weather"), generate)
    assert generate.grammar.startswith("start:") and "%json" in generate.grammar
    assert tools.reply(ToolRequest((WEATHER,), "none"), [], []) is None
    unknown = ChatTools(tokenizer, "{{ messages }}")
    with pytest.raises(ApiError) as caught:
        unknown.prepare(ToolRequest((WEATHER,), "auto"), orchestrator_pb2.GenerateRequest())
    assert caught.value.param == "tools"
