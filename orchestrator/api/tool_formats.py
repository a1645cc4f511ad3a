"""How each model family writes tool calls: the markers around them and how one call's text gives a name and JSON
arguments. A format is data (ToolFormat); the chat template says which one a model uses (detect_format).

The formats, as the families' chat templates write them (NAME a function name, ARGS its arguments as JSON):

    hermes       <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>  (Qwen2/2.5/3, Hermes; the demo)
    llama3_json  {"name": NAME, "parameters": ARGS}, the whole reply; several separated by "; "  (Llama 3.1-3.3)
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
                 <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    kimi_k2      <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGS
                 <|tool_call_end|><|tool_calls_section_end|>  (the call's id is functions.NAME:INDEX)
    gemma4       <|tool_call>call:NAME{key:value,...}<tool_call|>  (values in Gemma's notation, tool_gemma.py)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.api.tool_gemma import gemma_value


@dataclass(frozen=True)
class ParsedCall:
    """One call as the model wrote it; id is the format's own call id, or None when the server makes one."""

    name: str
    arguments: str  # a JSON object's text
    id: str | None = None


# Placeholders in ToolFormat.call_parts; every other part is literal text.
NAME = "{NAME}"  # the function's name as written
NAME_JSON = "{NAME_JSON}"  # the function's name as a JSON string
ARGUMENTS = "{ARGUMENTS}"  # a JSON object that validates against the function's parameters
INDEX = "{INDEX}"  # a decimal number (Kimi-K2's call index)


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format.

    A reply's tool calls start at `begin` (anywhere in the reply, or only at its start with `at_start`); each call
    lies between `call_begin` and `call_end` (both "" when the calls are bare JSON objects) and its text between
    them is read by `parse_call`. `call_parts` and `section` describe the same text for the grammar that forces
    calls (orchestrator.api.tool_grammar): the section's opening and closing markers around the calls, `separator`
    between two calls.
    """

    name: str
    detect: str  # text whose presence in a chat template marks the format
    begin: str
    call_begin: str
    call_end: str
    call_parts: tuple[str, ...]
    parse_call: Callable[[str], ParsedCall | None]
    section: tuple[str, str] = ("", "")
    separator: str = "\n"
    at_start: bool = False
    arguments_as_text: bool = False  # the template concatenates arguments as a string (else it takes an object)

    @property
    def markers(self) -> tuple[str, ...]:
        """The literal pieces of the format, which a tokenizer may hold as special tokens."""
        pieces = {self.begin, self.call_begin, self.call_end, *self.section}
        pieces.update(part for part in self.call_parts if part not in (NAME, NAME_JSON, ARGUMENTS, INDEX))
        return tuple(sorted(piece for piece in pieces if piece))


def arguments_text(arguments: Any) -> str | None:
    """A call's arguments as compact JSON text, or None unless they are an object (or text holding one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def _json_call(body: str, arguments_key: str) -> ParsedCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = arguments_text(call.get(arguments_key, call.get("arguments", {})))
    return None if arguments is None else ParsedCall(call["name"], arguments)


def _hermes_call(body: str) -> ParsedCall | None:
    return _json_call(body.strip(), "arguments")


def _llama_call(body: str) -> ParsedCall | None:
    return _json_call(body.strip(), "parameters")


DEEPSEEK_SEPARATOR = "<｜tool▁sep｜>"
DEEPSEEK_CALL = re.compile(
    r"\s*function" + DEEPSEEK_SEPARATOR + r"(?P<name>[^\n]+)\n```json\n(?P<args>.*)\n```\s*", re.S
)


def _deepseek_call(body: str) -> ParsedCall | None:
    match = DEEPSEEK_CALL.fullmatch(body)
    if match is None:
        return None
    arguments = arguments_text(match["args"])
    return None if arguments is None else ParsedCall(match["name"].strip(), arguments)


KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
KIMI_CALL = re.compile(
    r"\s*(?P<id>(?:functions\.)?(?P<name>[^:\s]+):\d+)\s*" + re.escape(KIMI_ARGUMENTS) + "(?P<args>.*)", re.S
)


def _kimi_call(body: str) -> ParsedCall | None:
    match = KIMI_CALL.fullmatch(body)
    if match is None:
        return None
    arguments = arguments_text(match["args"].strip())
    return None if arguments is None else ParsedCall(match["name"], arguments, id=match["id"])


GEMMA_CALL = re.compile(r"call:(?P<name>[^{\s]+)(?P<args>\{.*\})", re.S)


def _gemma_call(body: str) -> ParsedCall | None:
    match = GEMMA_CALL.fullmatch(body.strip())
    if match is None:
        return None
    try:
        arguments = gemma_value(match["args"])
    except ValueError:
        return None
    text = arguments_text(arguments)
    return None if text is None else ParsedCall(match["name"], text)


HERMES = ToolFormat(
    name="hermes",
    detect="<tool_call>",
    begin="<tool_call>",
    call_begin="<tool_call>",
    call_end="</tool_call>",
    call_parts=("<tool_call>", '\n{"name": ', NAME_JSON, ', "arguments": ', ARGUMENTS, "}\n", "</tool_call>"),
    parse_call=_hermes_call,
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    detect="<|python_tag|>",
    begin="{",
    call_begin="",
    call_end="",
    call_parts=('{"name": ', NAME_JSON, ', "parameters": ', ARGUMENTS, "}"),
    parse_call=_llama_call,
    separator="; ",
    at_start=True,
)
DEEPSEEK_V3 = ToolFormat(
    name="deepseek_v3",
    detect="<｜tool▁calls▁begin｜>",
    begin="<｜tool▁calls▁begin｜>",
    call_begin="<｜tool▁call▁begin｜>",
    call_end="<｜tool▁call▁end｜>",
    call_parts=(
        "<｜tool▁call▁begin｜>",
        "function",
        DEEPSEEK_SEPARATOR,
        NAME,
        "\n```json\n",
        ARGUMENTS,
        "\n```",
        "<｜tool▁call▁end｜>",
    ),
    parse_call=_deepseek_call,
    section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    arguments_as_text=True,
)
KIMI_K2 = ToolFormat(
    name="kimi_k2",
    detect="<|tool_calls_section_begin|>",
    begin="<|tool_calls_section_begin|>",
    call_begin="<|tool_call_begin|>",
    call_end="<|tool_call_end|>",
    call_parts=("<|tool_call_begin|>", "functions.", NAME, ":", INDEX, KIMI_ARGUMENTS, ARGUMENTS, "<|tool_call_end|>"),
    parse_call=_kimi_call,
    section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    separator="",
)
GEMMA4 = ToolFormat(
    name="gemma4",
    detect="<|tool_call>",
    begin="<|tool_call>",
    call_begin="<|tool_call>",
    call_end="<tool_call|>",
    call_parts=("<|tool_call>", "call:", NAME, ARGUMENTS, "<tool_call|>"),
    parse_call=_gemma_call,
    separator="",
)

# In the order they are looked for: a template that names several markers is the first one's.
FORMATS = (DEEPSEEK_V3, KIMI_K2, GEMMA4, HERMES, LLAMA3_JSON)
FORMAT_NAMES = {tool_format.name: tool_format for tool_format in FORMATS}
TOOL_CALL_FORMATS = tuple(FORMAT_NAMES)  # --tool-call-parser's choices beside auto


def detect_format(template: str | None, parser: str = "auto") -> ToolFormat | None:
    """The tool-call format `parser` names, or (auto) the one a chat template writes: None when it writes none that
    Tandem reads."""
    if parser != "auto":
        return FORMAT_NAMES[parser]
    if template is None:
        return None
    return next((tool_format for tool_format in FORMATS if tool_format.detect in template), None)
