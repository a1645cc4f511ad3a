"""Drafts shaped by a request's grammar before verification (GrammarState.shaped, target_server/admission.py): no
draft the grammar forbids is verified, a chain gets the tokens the grammar forces, and the output is what it is
without speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator.loop.structured import grammar_of
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.grammar import Grammars, GrammarState
from tandem.sampling.params import SamplingParams
from tandem.settings import DEMO_TARGET, KVCacheSettings
from tandem.wire.orchestrator_pb2 import GenerateRequest
from target_server.items import TARGET_ONLY, ItemStatus, OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.tokenizer import write_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"capital": {"enum": ["Paris", "London"]}, "ok": {"type": "boolean"}},
    "required": ["capital", "ok"],
    "additionalProperties": False,
}
GRAMMAR = grammar_of(GenerateRequest(json_schema=json.dumps(SCHEMA)))
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def demo_grammars() -> Grammars:
    return Grammars(DEMO_TARGET, 4096)


def encode(text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_TARGET)).encode(text, add_special_tokens=False)


def root_mask(state: GrammarState) -> torch.Tensor:
    return state.allowed(DraftTree(), 1, CPU)[0]


def test_a_chain_keeps_its_allowed_drafts_then_takes_the_forced_tokens(demo_grammars: Grammars) -> None:
    state = demo_grammars.state(GRAMMAR)
    before = root_mask(state)
    opening = encode('{"')
    shaped = state.shaped(DraftTree.chain(opening), room=32)
    # After '{"' the only key that can come first is "capital", then '":"' and the enum's shared nothing: the forced
    # run ends where Paris and London part.
    text = '{"capital":"'
    assert shaped.is_chain and shaped.tokens[: len(opening)] == tuple(opening)
    assert state.matcher.validate_tokens(list(shaped.tokens)) == len(shaped)
    assert len(shaped) > len(opening)
    assert list(shaped.tokens) == encode(text)[: len(shaped)]
    assert torch.equal(root_mask(state), before)  # the committed state did not move


def test_a_forbidden_draft_is_replaced_by_the_forced_tokens_and_room_bounds_them(demo_grammars: Grammars) -> None:
    state = demo_grammars.state(GRAMMAR)
    junk = encode("hello world")
    full = state.shaped(DraftTree.chain(junk), room=32)
    assert full.tokens and full.tokens[0] == encode("{")[0]  # the grammar forces the opening brace
    assert state.shaped(DraftTree.chain(junk), room=2).tokens == full.tokens[:2]
    assert state.shaped(DraftTree.chain(junk), room=0).tokens == ()


def test_a_tree_loses_the_nodes_the_grammar_forbids_with_their_subtrees(demo_grammars: Grammars) -> None:
    state = demo_grammars.state(grammar_of(GenerateRequest(choice=["alpha beta", "delta"])))
    alpha, delta, junk = encode("alpha")[0], encode("delta")[0], encode("x")[0]
    # nodes: 0 alpha, 1 junk (forbidden), 2 child of junk, 3 delta, 4 junk under alpha (forbidden)
    tree = DraftTree.of([alpha, junk, alpha, delta, junk], [-1, -1, 1, -1, 0])
    assert state.shaped(tree, room=32) == DraftTree((alpha, delta), (-1, -1))


def test_a_tree_where_the_grammar_forces_the_way_becomes_the_forced_chain(demo_grammars: Grammars) -> None:
    state = demo_grammars.state(GRAMMAR)
    junk = encode("hello world")[:2]
    tree = DraftTree.of([junk[0], junk[1], junk[1]], [-1, -1, 0])  # every node forbidden: nothing to verify
    shaped = state.shaped(tree, room=6)
    assert shaped.is_chain and list(shaped.tokens) == encode('{"capital":"')[:6]
    opening = encode("{")[0]
    kept = state.shaped(DraftTree.of([opening, junk[0]], [-1, -1]), room=1)  # a tree as deep as the forced chain
    assert kept == DraftTree((opening,), (-1,))


@pytest.fixture(scope="module")
def tiny_runner_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Grammars]:
    directory = write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())
    write_tokenizer(directory, 320)
    return directory, Grammars(directory, 320)


def constrained_runner(parts: tuple[Path, Grammars], shaping: bool = True) -> TargetRunner:
    """A runner with the request "a" prefilled under GRAMMAR; without `shaping` its items are verified as sent (the
    grammar only masks), the reference."""
    directory, grammars = parts
    runner = TargetRunner(
        load_target(directory), KVCacheSettings(num_blocks=32, block_size=16), max_context=256, grammars=grammars
    )
    if not shaping:
        runner.admission._shaped = lambda item, request, start: item  # type: ignore[method-assign]
    return runner


def constrained_tokens(
    parts: tuple[Path, Grammars], drafts: list[int], count: int, shaping: bool = True
) -> tuple[list[int], list[int]]:
    """`count` new tokens of greedy constrained decoding, verifying `drafts` each round; the tokens and each
    round's accepted count (the prompt's round first)."""
    runner = constrained_runner(parts, shaping)
    first = runner.prefill("a", [1, 40, 41, 42], SamplingParams(grammar=GRAMMAR))
    tokens, accepted = list(first.new_tokens), [first.accepted]
    while len(tokens) < count:
        result = runner.verify("a", drafts)
        tokens += result.new_tokens
        accepted.append(result.accepted)
    return tokens[:count], accepted


def test_constrained_greedy_with_shaped_drafts_equals_target_only(tiny_runner_parts: tuple[Path, Grammars]) -> None:
    plain, unforced = constrained_tokens(tiny_runner_parts, [], 24, shaping=False)
    assert not any(unforced)
    for drafts in ([5, 6, 7], [300, 301]):  # junk the grammar forbids: it is cut, forced tokens take its place
        speculative, accepted = constrained_tokens(tiny_runner_parts, drafts, 24)
        assert speculative == plain
        assert max(accepted) > len(drafts)  # forced tokens beyond the drafts were verified and accepted
    text = grammars_text(tiny_runner_parts, plain)
    assert text.startswith('{"capital":"'), text


def test_rounds_without_drafts_take_the_forced_tokens(tiny_runner_parts: tuple[Path, Grammars]) -> None:
    """k = 0 (a paused batch, target-only requests): the prompt's last chunk and every decode item verify what the
    grammar forces; a multi-token decode stops after a pass that took forced tokens (their KV filled its room)."""
    plain, _ = constrained_tokens(tiny_runner_parts, [], 24, shaping=False)
    forced, accepted = constrained_tokens(tiny_runner_parts, [], 24)
    assert forced == plain and accepted[0] > 0  # '{"capital":"' forced right after the prompt
    runner = constrained_runner(tiny_runner_parts)
    tokens = list(runner.prefill("a", [1, 40, 41, 42], SamplingParams(grammar=GRAMMAR)).new_tokens)
    passes = []
    while len(tokens) < 24:
        (result,) = runner.step([StepItem("a", 1, decode_steps=4)])
        tokens += result.new_tokens
        passes.append(len(result.new_tokens) - result.accepted)
        assert result.accepted == 0 or passes[-1] == 1
    assert tokens[:24] == plain and sum(passes) < len(tokens)  # fewer forward passes than tokens


def test_a_constrained_request_reopened_with_its_generated_tokens_goes_on_under_its_grammar(
    tiny_runner_parts: tuple[Path, Grammars],
) -> None:
    """A request resumed on a restarted target (OpenRequest.generated): its grammar is advanced past them, so it goes
    on as before; generated tokens the grammar forbids are refused naming them."""
    plain, _ = constrained_tokens(tiny_runner_parts, [], 24)
    prompt, sampling = [1, 40, 41, 42], SamplingParams(grammar=GRAMMAR)
    runner = constrained_runner(tiny_runner_parts)
    opening = OpenRequest(prompt, sampling, generated=plain[:10])
    (result,) = runner.step([StepItem("b", len(prompt) + 10, open=opening, stream=TARGET_ONLY)])
    tokens = plain[:10] + result.new_tokens
    while len(tokens) < 24:
        tokens += runner.verify("b", []).new_tokens
    assert tokens[:24] == plain
    refused = OpenRequest(prompt, sampling, generated=[plain[0], 5])  # 5 is not what the grammar allows there
    (bad,) = runner.step([StepItem("c", len(prompt) + 2, open=refused, stream=TARGET_ONLY)])
    assert bad.status is ItemStatus.INVALID and bad.message.startswith("generated: grammar: token 5"), bad.message
    assert "c" not in runner.requests


def grammars_text(parts: tuple[Path, Grammars], tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(str(parts[0])).decode(tokens))


def test_the_drafters_acceptance_leaves_out_the_forced_tokens() -> None:
    """Adaptive k weighs what drafting adds (orchestrator/loop/accounting.py): of a constrained round's accepted tokens,
    those along a path of the drafts sent, not those the grammar forced in."""
    chain, tree = DraftTree.chain([5, 6, 7]), DraftTree.of([5, 8, 6, 9], [-1, -1, 0, 1])
    assert [chain.matched(tokens) for tokens in ([], [5, 6], [5, 6, 7, 3, 4], [9, 6])] == [0, 2, 3, 0]
    assert [tree.matched(tokens) for tokens in ([8, 9, 1], [5, 6], [5, 9])] == [2, 2, 1]
    assert DraftTree().matched([4, 4]) == 0
