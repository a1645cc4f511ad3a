"""Structured output under every draft kind but the default chain (tests/integration/test_http_api.py has that one):
trees, n-gram drafts in the orchestrator, the hybrid of both and the demo's DFlash and DSpark block drafters, through
`tandem serve` and the official client. The JSON validates and is the same with and without speculation, and
constrained requests accept drafts."""

from __future__ import annotations

import json

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


@pytest.fixture(scope="module", params=list(KINDS))
def stack(request: pytest.FixtureRequest, stacks: SharedStacks) -> Stack:
    draft, arguments = KINDS[request.param]
    return stacks.get(DEMO_TARGET, draft, *arguments, *DEMO_HTTP)


def test_json_schema_and_json_object_validate_and_speculation_does_not_change_them(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    chats = [json_schema_chat(client, disable) for disable in (False, True)]
    json_object = {"response_format": {"type": "json_object"}}
    objects = [structured_completion(client, json_object, disable, max_tokens=48) for disable in (False, True)]
    assert chats[0] == chats[1] and objects[0] == objects[1]
    text, finish_reason = chats[0]
    assert finish_reason == "stop"
    jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    text, finish_reason = objects[0]
    if finish_reason == "stop":  # an object may still be open at max_tokens
        assert isinstance(json.loads(text), dict), text


def test_constrained_greedy_over_grpc_accepts_drafts(stack: Stack) -> None:
    speculative = generate(stack.address, prompt=PROMPT, max_new_tokens=64, json_schema=json.dumps(BOUNDED_SCHEMA))
    alone = generate(
        stack.address,
        prompt=PROMPT,
        max_new_tokens=64,
        json_schema=json.dumps(BOUNDED_SCHEMA),
        disable_speculation=True,
    )
    assert speculative.token_ids == alone.token_ids
    jsonschema.validate(json.loads(speculative.text), BOUNDED_SCHEMA)
    # Keys, quotes and colons are forced: verified in every kind's rounds whatever the drafts were, so a round
    # commits more than one token on average (a third of the document's tokens are forced).
    stats = speculative.stats
    assert stats.accepted_tokens >= stats.completion_tokens // 3 and stats.rounds < stats.completion_tokens, stats
