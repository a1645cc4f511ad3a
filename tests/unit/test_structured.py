"""Structured output requests (orchestrator/loop/structured.py) and the target's grammar masks
(tandem/sampling/grammar.py) on the demo's tokenizer."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from orchestrator.loop.structured import from_openai, grammar_of
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.grammar import Grammars
from tandem.settings import DEMO_TARGET
from tandem.wire.orchestrator_pb2 import GenerateRequest

JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "x"}}  # without its schema
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(DEMO_TARGET, 4100)  # 4 rows past the tokenizer's 4096, never allowed


def encode(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET)).encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema: Invalid type: nonsense"),
        ({"json_schema": "{"}, "json_schema: not JSON"),
        ({"json_schema": "[1]"}, "json_schema: must be a JSON object (a schema), got list"),
        ({"regex": "a(b"}, "regex: "),
        ({"grammar": "start: ("}, "grammar: "),
        ({"choice": ["a", ""]}, "choice: the options must not be empty strings"),
        ({"regex": "a", "choice": ["x"]}, "choice: only one of json_schema, json_object, regex, choice, grammar"),
    ],
)
def test_a_grammar_that_cannot_be_compiled_is_refused_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        grammar_of(GenerateRequest(**fields))
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {**JSON_FORMAT, "json_schema": {"schema": SCHEMA}}}, {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"structured_outputs": {"grammar": "start: \"x\""}}, {"grammar": 'start: "x"'}),
        ({"response_format": {"type": "text"}}, {}),
    ],
)  # fmt: skip
def test_openai_and_vllm_fields_map_to_the_request(body: dict[str, Any], fields: dict[str, Any]) -> None:
    generate = GenerateRequest()
    from_openai(body, generate)
    assert generate == GenerateRequest(**fields)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format: type 'yaml' is not supported"),
        ({"response_format": JSON_FORMAT}, "response_format.json_schema.schema: missing"),
        ({"guided_choice": "yes"}, "structured_outputs.choice: must be a non-empty list of strings"),
    ],
)  # fmt: skip
def test_malformed_openai_fields_are_refused_naming_them(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace(".", r"\.").replace("(", r"\(")):
        from_openai(body, GenerateRequest())


def test_each_row_allows_what_its_path_reaches(grammars: Grammars) -> None:
    state = grammars.state(grammar_of(GenerateRequest(json_schema=json.dumps(SCHEMA))))
    forced = encode('{"ok":')
    tree = DraftTree.chain([*forced, encode("x")[0]])
    allowed = state.allowed(tree, 1 + len(tree), torch.device("cpu"))  # [rows, 4100]
    assert allowed.shape == (1 + len(tree), 4100) and not allowed[:, 4096:].any()
    for row, token in enumerate(forced):  # the path so far leaves exactly one way on
        assert allowed[row].nonzero().flatten().tolist() == [token]
    after_colon = allowed[len(forced)]
    assert after_colon[encode("true")[0]] and after_colon[encode("false")[0]] and not after_colon[encode("x")[0]]
    # The last node's path ends in "x", which the grammar forbids: the row is unreachable and takes its parent's mask.
    assert torch.equal(allowed[-1], allowed[-2])


def test_a_rows_mask_equals_the_mask_after_committing_its_path(grammars: Grammars) -> None:
    grammar = grammar_of(GenerateRequest(choice=["alpha beta", "alpha gamma", "delta"]))
    tokens = encode("alpha gamma")
    tree = DraftTree.of([*tokens, encode("delta")[0]], [-1, *range(len(tokens) - 1), -1])
    speculative = grammars.state(grammar).allowed(tree, 1 + len(tree), torch.device("cpu"))
    for row, path in enumerate(tree.paths()):
        committed = grammars.state(grammar)
        committed.commit(path)
        assert torch.equal(speculative[row], committed.allowed(DraftTree(), 1, torch.device("cpu"))[0]), path
