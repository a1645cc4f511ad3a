"""The grammar that forces tool calls: `tool_choice` "required" (a call to any of the tools) or a named function.

It is a Lark grammar in llguidance's dialect, carried as the request's `grammar` like any structured output, so the
target masks every verified row by it and forced calls are the same with and without speculation. It writes the
model's own format (orchestrator.api.tool_formats), and each call's arguments are `%json` of that function's
parameters, compact as structured JSON output is: the arguments always validate. A marker that the tokenizer holds
as one special token is written `<[id]>` (that token), any other as its text. After the calls only EOS is allowed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
from transformers import PreTrainedTokenizerBase

from orchestrator.api.tool_formats import ARGUMENTS, INDEX, NAME, NAME_JSON, ToolFormat
from orchestrator.loop.structured import JSON_DEFAULTS
from orchestrator.loop.text import special_token_ids
from tandem.sampling.grammar_check import grammar_error


def special_marker_ids(tokenizer: PreTrainedTokenizerBase, tool_format: ToolFormat) -> dict[str, int]:
    """The format's markers that are one special token of this tokenizer (decoding skips those unless kept)."""
    special = special_token_ids(tokenizer)
    found = {}
    for marker in tool_format.markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in special:
            found[marker] = ids[0]
    return found


def parameters_error(parameters: Mapping[str, Any]) -> str:
    """What llguidance finds wrong with a function's parameters schema ("" if nothing)."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(parameters), defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as error:
        return str(error)
    return grammar_error(str(grammar))


def tool_grammar(
    tool_format: ToolFormat,
    functions: Mapping[str, Mapping[str, Any]],
    parallel: bool,
    special_ids: Mapping[str, int],
) -> str:
    """Lark text forcing one call (several, separated as the format separates them, when `parallel`) to one of
    `functions` (name -> parameters schema)."""

    def literal(text: str) -> str:
        if text in special_ids:
            return f"<[{special_ids[text]}]>"
        return json.dumps(text, ensure_ascii=False)

    rules = []
    for number, (name, parameters) in enumerate(functions.items()):
        parts = [_part(part, name, number, literal) for part in tool_format.call_parts]
        schema = {**parameters, "x-guidance": dict(JSON_DEFAULTS)}
        rules.append(f"call_{number}: {' '.join(parts)}")
        rules.append(f"args_{number}: %json {json.dumps(schema, ensure_ascii=False)}")
    calls = " | ".join(f"call_{number}" for number in range(len(functions)))
    repeated = f" ({literal(tool_format.separator)} call)*" if parallel and tool_format.separator else ""
    repeated = repeated or (" call*" if parallel else "")
    opening, closing = (literal(marker) if marker else "" for marker in tool_format.section)
    start = f"start: {opening} call{repeated} {closing}".rstrip()
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


def _part(part: str, name: str, number: int, literal: Any) -> str:
    if part == NAME:
        return str(literal(name))
    if part == NAME_JSON:
        return str(literal(json.dumps(name)))
    if part == ARGUMENTS:
        return f"args_{number}"
    if part == INDEX:
        return "/[0-9]+/"
    return str(literal(part))


def forced_functions(tools: Sequence[Mapping[str, Any]], named: str | None) -> dict[str, Mapping[str, Any]]:
    """name -> parameters of the functions a forced call may name: the named one, or every tool."""
    functions = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    return {named: functions[named]} if named is not None else functions
