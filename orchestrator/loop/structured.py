"""Structured output: a request's JSON schema, JSON object, regex, choice or Lark grammar as the grammar text the
target masks its rows with (tandem.sampling.grammar, llguidance).

JSON is compact (`whitespace_flexible` off: no whitespace between tokens but what the separators need), so a weak
model cannot pad forever and a bounded schema finishes inside max_tokens. A grammar that does not compile is refused
naming the field. This runs in validate_request, off the event loop; compiled checks are cached by text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import llguidance

from tandem.sampling.grammar_check import grammar_error
from tandem.wire import orchestrator_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the type stubs only

JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def grammar_of(request: orchestrator_pb2.GenerateRequest) -> str:
    """The request's grammar text ("" when it asks for none); raises ValueError naming a field that is wrong."""
    given = [name for name in FIELDS if getattr(request, name)]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: only one of {', '.join(FIELDS)} may be set, got {' and '.join(given)}")
    if not given:
        return ""
    name = given[0]
    grammar = _grammar(request, name)
    error = grammar_error(grammar)
    if error:
        raise ValueError(f"{name}: {error}")
    return grammar


def refused_resume(grammar: str, tokens: Sequence[int], tokenizer: Any) -> str:
    """Where a grammar refuses the tokens a resumed stream sent (e.g. "[3]: the grammar does not allow token 17
    there"), "" where it allows them all. Tokens after the grammar has ended are the target's business, as in
    tandem.sampling.grammar.GrammarState.commit."""
    if not grammar or not tokens:
        return ""
    matcher = llguidance.LLMatcher(_llg_tokenizer(tokenizer), grammar)
    for index, token in enumerate(tokens):
        if matcher.is_stopped():
            return ""
        if not matcher.consume_token(token):
            return f"[{index}]: the grammar does not allow token {token} there"
    return ""


@lru_cache(maxsize=4)
def _llg_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf  # imported with the first resume of a constrained request: it costs an import otherwise

    return llguidance.hf.from_tokenizer(tokenizer)


def _grammar(request: orchestrator_pb2.GenerateRequest, name: str) -> str:
    if name == "json_schema":
        try:
            schema = json.loads(request.json_schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema: not JSON ({error})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: must be a JSON object (a schema), got {type(schema).__name__}")
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS))
    if name == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS))
    if name == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(request.regex))
    if name == "choice":
        if any(not option for option in request.choice):
            raise ValueError("choice: the options must not be empty strings")
        return str(llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(option) for option in request.choice)))
    return str(llguidance.LLMatcher.grammar_from_lark(request.grammar))


def from_openai(body: Mapping[str, Any], generate: orchestrator_pb2.GenerateRequest) -> None:
    """Sets `generate`'s structured output from an OpenAI body: `response_format` (json_object, or json_schema with
    its `schema`), or vLLM's `structured_outputs` {json, regex, choice, grammar} and `guided_json`, `guided_regex`,
    `guided_choice`, `guided_grammar`. Raises ValueError naming the field; two kinds at once are refused later."""
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            generate.json_object = True
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema: missing (a JSON schema object)")
            generate.json_schema = json.dumps(schema)
        else:
            raise ValueError(f"response_format: type {kind!r} is not supported (text, json_object, json_schema)")
    options = body.get("structured_outputs") or {}
    if not isinstance(options, dict):
        raise ValueError("structured_outputs: must be an object with one of json, regex, choice, grammar")
    for name, value in (
        ("json", options.get("json", body.get("guided_json"))),
        ("regex", options.get("regex", body.get("guided_regex"))),
        ("choice", options.get("choice", body.get("guided_choice"))),
        ("grammar", options.get("grammar", body.get("guided_grammar"))),
    ):
        if value is not None:
            _set_vllm_field(generate, name, value)


def _set_vllm_field(generate: orchestrator_pb2.GenerateRequest, name: str, value: Any) -> None:
    if name == "json":
        generate.json_schema = json.dumps(value) if isinstance(value, dict) else str(value)
    elif name == "choice":
        if not isinstance(value, list) or not all(isinstance(option, str) for option in value) or not value:
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
        generate.choice.extend(value)
    elif not isinstance(value, str):
        raise ValueError(f"structured_outputs.{name}: must be a string")
    else:
        setattr(generate, name, value)
