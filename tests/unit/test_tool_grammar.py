"""The grammar that forces tool calls, compiled by llguidance over a real tokenizer: a call in the model's format
whose arguments validate is accepted to the end; a wrong name, wrong arguments or a second call where one is
allowed are not."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.api.tool_formats import DEEPSEEK_V3, FORMATS, GEMMA4, HERMES, KIMI_K2, LLAMA3_JSON, ToolFormat
from orchestrator.api.tool_grammar import parameters_error, special_marker_ids, tool_grammar
from tandem.settings import DEMO_TARGET

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city"],
    "additionalProperties": False,
}
NOW: dict[str, Any] = {"type": "object", "properties": {}}
GOOD = {"city": "Oslo", "days": 3}
BAD = {"city": "Paris"}


@cache
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(DEMO_TARGET))


def call_text(tool_format: ToolFormat, name: str, arguments: dict[str, Any], index: int = 0) -> str:
    """One call as the format writes it, arguments compact as the grammar writes them."""
    args = json.dumps(arguments, separators=(",", ":"))
    return {
        "hermes": f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>',
        "llama3_json": f'{{"name": "{name}", "parameters": {args}}}',
        "deepseek_v3": f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>",
        "kimi_k2": f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>",
        "gemma4": f"<|tool_call>call:{name}{args}<tool_call|>",
    }[tool_format.name]


def reply(tool_format: ToolFormat, *calls: str) -> str:
    opening, closing = tool_format.section
    return opening + tool_format.separator.join(calls) + closing


def accepts(grammar: str, text: str, tokens: PreTrainedTokenizerBase | None = None) -> bool:
    tokens = tokens or tokenizer()
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(compiled) == ""
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokens), compiled)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokens.encode(text, add_special_tokens=False)
    if matcher.validate_tokens(ids) < len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return bool(matcher.is_accepting())


@pytest.mark.parametrize("tool_format", FORMATS, ids=lambda tool_format: tool_format.name)
def test_a_named_call_accepts_valid_arguments_only(tool_format: ToolFormat) -> None:
    grammar = tool_grammar(tool_format, {"weather": WEATHER}, parallel=False, special_ids={})
    assert accepts(grammar, reply(tool_format, call_text(tool_format, "weather", GOOD)))
    assert not accepts(grammar, reply(tool_format, call_text(tool_format, "weather", BAD)))
    assert not accepts(grammar, reply(tool_format, call_text(tool_format, "time", {})))
    two = reply(tool_format, call_text(tool_format, "weather", GOOD), call_text(tool_format, "weather", GOOD, 1))
    assert not accepts(grammar, two)


@pytest.mark.parametrize("tool_format", FORMATS, ids=lambda tool_format: tool_format.name)
def test_required_accepts_any_tool_and_several_calls(tool_format: ToolFormat) -> None:
    grammar = tool_grammar(tool_format, {"weather": WEATHER, "time": NOW}, parallel=True, special_ids={})
    calls = [call_text(tool_format, "time", {}), call_text(tool_format, "weather", GOOD, 1)]
    assert accepts(grammar, reply(tool_format, calls[0]))
    assert accepts(grammar, reply(tool_format, *calls))
    assert not accepts(grammar, reply(tool_format, call_text(tool_format, "news", {})))
    assert not accepts(grammar, "It is sunny.")


def test_markers_that_are_special_tokens_are_those_tokens() -> None:
    tokens = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    markers = [marker for marker in KIMI_K2.markers if marker.startswith("<|")]
    tokens.add_special_tokens({"additional_special_tokens": markers})
    special = special_marker_ids(tokens, KIMI_K2)
    assert set(special) == set(markers) and len(markers) == 5
    grammar = tool_grammar(KIMI_K2, {"weather": WEATHER}, parallel=False, special_ids=special)
    assert f"<[{special['<|tool_call_begin|>']}]>" in grammar
    assert accepts(grammar, reply(KIMI_K2, call_text(KIMI_K2, "weather", GOOD)), tokens)
    assert special_marker_ids(tokenizer(), HERMES) == {}


def test_a_schema_llguidance_cannot_compile_is_named() -> None:
    assert parameters_error(WEATHER) == ""
    assert parameters_error({"type": "object", "properties": {"a": {"type": "frobnicate"}}}) != ""


@pytest.mark.parametrize("tool_format", [HERMES, LLAMA3_JSON, DEEPSEEK_V3, GEMMA4], ids=lambda f: f.name)
def test_forced_calls_read_back_as_calls(tool_format: ToolFormat) -> None:
    from orchestrator.api.tool_stream import ToolCall, ToolCallStream

    stream = ToolCallStream(tool_format)
    text = reply(tool_format, call_text(tool_format, "weather", GOOD), call_text(tool_format, "time", {}, 1))
    pieces = stream.feed(text) + stream.finish()
    assert [(piece.name, json.loads(piece.arguments)) for piece in pieces if isinstance(piece, ToolCall)] == [
        ("weather", GOOD),
        ("time", {}),
    ]
    assert all(not isinstance(piece, str) for piece in pieces)
