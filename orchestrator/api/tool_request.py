"""A chat request's tools, checked: `tools`, `tool_choice`, `parallel_tool_calls`, and the tool calls of earlier
assistant messages. Every refusal is a ValueError "field: reason" (openai_protocol answers it with 400)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.api.tool_formats import arguments_text

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule, dots allowed as vLLM allows them
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """The tools the template renders, as the client sent them (parameters filled in), and what is asked of them.

    choice "none": rendered, never parsed; "auto": parsed from what the model writes; "required" and "named" (the
    function `named`): forced by a grammar (orchestrator.api.tool_grammar).
    """

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    @property
    def parsed(self) -> bool:
        return self.choice != "none"


def parse_tools(body: Mapping[str, Any], constrained: str | None = None) -> ToolRequest | None:
    """The request's tools, or None when it has none (and asks for none). `constrained`: the structured output
    field the request sets, if any, which parsed tools refuse (the output is either calls or that structure)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls: must be true or false, got {json.dumps(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    if not isinstance(tools, list):
        raise ValueError("tools: must be a list of {type: function, function: {name, description, parameters}}")
    checked = tuple(_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise ValueError(f"tools[{index}].function.name: {name!r} is named twice")
    kind, named = _choice(choice, names)
    if kind != "none" and constrained is not None:
        field = "response_format" if body.get("response_format") is not None else constrained
        raise ValueError(f"{field}: cannot be combined with tools unless tool_choice is none")
    return ToolRequest(checked, kind, named, parallel is not False)


def _tool(tool: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f'{where}.type: must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function: must be an object with name, description and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name: must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description: must be a string")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f'{where}.function.parameters: must be a JSON schema of an object ({{"type": "object", ...}})')
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ValueError(f"tool_choice: must be none, auto, required or a function, got {choice!r}")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice: must be none, auto, required or {"type": "function", "function": {"name"}}')
    if name not in names:
        raise ValueError(f"tool_choice: names the function {name!r}, which is not in tools ({', '.join(names)})")
    return "named", name


def message_tool_fields(message: Mapping[str, Any], role: str, where: str) -> dict[str, Any]:
    """A message's fields beside role and content: an assistant's `tool_calls`, a tool's `tool_call_id` (and
    `name`)."""
    if role == "assistant" and message.get("tool_calls") is not None:
        return {"tool_calls": message_tool_calls(message["tool_calls"], f"{where}.tool_calls")}
    if role != "tool":
        return {}
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str):
        raise ValueError(f"{where}.tool_call_id: must be the id of the tool call this message answers")
    name = message.get("name")
    return {"tool_call_id": call_id, **({"name": name} if isinstance(name, str) else {})}


def message_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each {id, type: function, function: {name, arguments (JSON text)}}."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}: must be a list of tool calls")
    checked = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{at}.function: must be an object with name and arguments")
        arguments = arguments_text(function.get("arguments", "{}"))
        if arguments is None:
            raise ValueError(f"{at}.function.arguments: must be a JSON object (as text)")
        call_id = call.get("id", f"call_{index}")
        if not isinstance(call_id, str):
            raise ValueError(f"{at}.id: must be a string")
        checked.append(
            {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return checked
