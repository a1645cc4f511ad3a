"""`tandem bench --structured`: the held-out prompts, each asked for a JSON document of one of these schemas.

Every configuration then runs twice, on the same prompts: unconstrained (free text, as without the flag) and
constrained (each request carries its prompt's schema: the target masks every verified position with it, drafts it
forbids are cut and the tokens it forces are verified without being drafted; target_server/admission.py). The report
has a row of each, so acceptance and speed of structured output stand beside free text.

Strings and arrays are bounded so that a document ends inside the benchmark's token budget; a constrained request
ends at its document's end (its EOS), not at the budget.
"""

from __future__ import annotations

import json

from bench.prompts import held_out_prompts

CONSTRAINED = "json schema"  # the rows' name for constrained runs (RunResult.constraint)

_NAME = {"type": "string", "maxLength": 24}
SCHEMAS = (
    {
        "type": "object",
        "properties": {
            "name": _NAME,
            "arguments": {"type": "array", "items": _NAME, "maxItems": 4},
            "returns": {"enum": ["None", "int", "str", "bool", "list", "dict"]},
        },
        "required": ["name", "arguments", "returns"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["function", "method", "class"]},
            "public": {"type": "boolean"},
            "line_count": {"type": "integer", "minimum": 1, "maximum": 200},
            "summary": {"type": "string", "maxLength": 40},
        },
        "required": ["kind", "public", "line_count", "summary"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "test": {
                "type": "object",
                "properties": {
                    "function": _NAME,
                    "inputs": {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                    "expected": {"type": "integer"},
                },
                "required": ["function", "inputs", "expected"],
                "additionalProperties": False,
            },
            "passed": {"type": "boolean"},
        },
        "required": ["test", "passed"],
        "additionalProperties": False,
    },
)


def structured_prompts(count: int) -> tuple[list[str], list[str]]:
    """`count` prompts (the held-out code, then a line asking for JSON) and the schema of each, as JSON text."""
    prompts = [f"{prompt}# The definition above as JSON:\n" for prompt in held_out_prompts(count)]
    schemas = [json.dumps(SCHEMAS[index % len(SCHEMAS)]) for index in range(count)]
    return prompts, schemas
