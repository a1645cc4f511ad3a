"""Structured output under every draft kind but the default chain (tests/integration/test_http_api.py has that one):
trees, n-gram drafts in the orchestrator, the hybrid of both and the demo's DFlash and DSpark block drafters, through
`tandem serve` and the official client. The JSON validates and is the same with and without speculation, and
constrained requests accept drafts. Every stack serves the demo target, so the answers without speculation are asked
once, of the first stack, and compared with every kind's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import openai
import pytest

from tandem.settings import DEMO_DRAFT, DEMO_DRAFTS, DEMO_TARGET
from tests.integration.stack import DEMO_HTTP, TREE, SharedStacks, Stack, generate
from tests.integration.test_http_api import BOUNDED_SCHEMA, PROMPT, json_schema_chat, structured_completion

KINDS = {
    "eagle3 tree": (DEMO_DRAFT, TREE),
    "ngram": (None, ["--draft", "ngram"]),
    "hybrid tree": (DEMO_DRAFT, ["--hybrid-ngram", *TREE]),
    "dflash block": (DEMO_DRAFTS["dflash"], []),
    "dspark block": (DEMO_DRAFTS["dspark"], []),
}


ALONE: dict[str, Any] = {}  # the answers without speculation, by request


def alone(name: str, ask: Callable[[], Any]) -> Any:
    """The answer to request `name` without speculation: asked once, as any stack of the demo target gives it."""
    if name not in ALONE:
        ALONE[name] = ask()
    return ALONE[name]


@pytest.fixture(scope="module", params=list(KINDS))
def stack(request: pytest.FixtureRequest, stacks: SharedStacks) -> Stack:
    draft, arguments = KINDS[request.param]
    return stacks.get(DEMO_TARGET, draft, *arguments, *DEMO_HTTP)


def test_json_schema_and_json_object_validate_and_speculation_does_not_change_them(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    json_object = {"response_format": {"type": "json_object"}}
    chats = [json_schema_chat(client, False), alone("chat", lambda: json_schema_chat(client, True))]
    objects = [
        structured_completion(client, json_object, False, max_tokens=48),
        alone("object", lambda: structured_completion(client, json_object, True, max_tokens=48)),
    ]
    assert chats[0] == chats[1] and objects[0] == objects[1]
    text, finish_reason = chats[0]
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    text, finish_reason = objects[0]
    if finish_reason == "stop":  # an object may still be open at max_tokens
        assert isinstance(json.loads(text), dict), text


def test_constrained_greedy_over_grpc_accepts_drafts(stack: Stack) -> None:
    speculative = generate(stack.address, prompt=PROMPT, max_new_tokens=64, json_schema=json.dumps(BOUNDED_SCHEMA))
    schema = json.dumps(BOUNDED_SCHEMA)
    target_only = alone(
        "grpc",
        lambda: generate(stack.address, prompt=PROMPT, max_new_tokens=64, json_schema=schema, disable_speculation=True),
    )
    assert speculative.token_ids == target_only.token_ids
    jsonschema.validate(json.loads(speculative.text), BOUNDED_SCHEMA)
    # Keys, quotes and colons are forced: verified in every kind's rounds whatever the drafts were, so a round
    # commits more than one token on average (a third of the document's tokens are forced).
    stats = speculative.stats
    assert stats.accepted_tokens >= stats.completion_tokens // 3 and stats.rounds < stats.completion_tokens, stats
