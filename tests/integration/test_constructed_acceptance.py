"""Checkpoints whose predictions are known, so acceptance is known exactly.

The target has a zero final-norm weight: every logit is 0, so its greedy token is always id 0.
The draft has a zero final-norm weight too: its argmax is draft id 0, which d2t maps to target id
0 + d2t[0]. With d2t[0] == 0 the draft always agrees with the target (full acceptance, k per round);
with d2t[0] == 5 it always proposes 5, which the target never emits (zero acceptance).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness import scraped_round_seconds
from tests.helpers.checkpoints import TinyEagle3Spec, TinyTargetSpec, write_tiny_eagle3, write_tiny_target
from tests.integration.stack import draft_info, generate, serve, service_addresses

NUM_STEPS = 4
ROUNDS = 4
MAX_NEW_TOKENS = 1 + ROUNDS * (NUM_STEPS + 1)  # prefill token + full rounds of k drafts and a bonus


@pytest.fixture(scope="module")
def constant_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyTargetSpec(num_layers=6, zero_final_norm=True)
    return write_tiny_target(tmp_path_factory.mktemp("constant-target"), spec)


def constant_draft(directory: Path, target: Path, first_offset: int) -> Path:
    draft_vocab = 64
    # Draft id 0 -> target id first_offset; the other draft ids map to target ids 64..126 (never emitted).
    d2t = [first_offset] + [63] * (draft_vocab - 1)
    spec = TinyEagle3Spec(layer_ids=(1, 2, 3), draft_vocab_size=draft_vocab, d2t=d2t, zero_final_norm=True)
    return write_tiny_eagle3(directory, target, spec)


@pytest.mark.parametrize(
    ("first_offset", "accepted_per_round", "draft_ahead"),
    [(0, NUM_STEPS, "8"), (5, 0, "8"), (0, NUM_STEPS, "0")],
)
def test_known_acceptance(
    tmp_path: Path, constant_target: Path, first_offset: int, accepted_per_round: int, draft_ahead: str
) -> None:
    draft = constant_draft(tmp_path / "draft", constant_target, first_offset)
    flags = ("--speculative-num-steps", str(NUM_STEPS), "--draft-ahead", draft_ahead)
    with serve(constant_target, draft, *flags) as stack:
        completion = generate(stack.address, input_ids=[5, 6, 7, 8], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        info = draft_info(service_addresses(stack.log)["draft"])
        parts = scraped_round_seconds(f"{stack.http_url}/metrics")()  # where the rounds' time went
    assert completion.token_ids == [0] * MAX_NEW_TOKENS
    stats = completion.stats
    if accepted_per_round == NUM_STEPS:
        # Every round: k drafts, all accepted, plus the bonus token.
        assert (stats.rounds, stats.draft_tokens, stats.accepted_tokens) == (
            ROUNDS,
            NUM_STEPS * ROUNDS,
            NUM_STEPS * ROUNDS,
        )
    else:
        # Every round commits one correction token; a round never drafts past max_new_tokens, so with r tokens
        # still to go it drafts min(k, r - 1).
        remaining = range(MAX_NEW_TOKENS - 1, 0, -1)
        assert stats.rounds == MAX_NEW_TOKENS - 1
        assert stats.draft_tokens == sum(min(NUM_STEPS, r - 1) for r in remaining)
        assert stats.accepted_tokens == 0
        assert list(stats.accepted_per_position) == [0] * NUM_STEPS
    # Both services computed in the rounds, and the calls cost more than the computation in them.
    assert parts["draft"] + parts["drafted_ahead"] > 0 and parts["verify"] > 0 and parts["wire"] > 0
    # Drafting ahead serves every round that drafts, the first included (the prompt's last chunk asks for it, so the
    # replica ingests the prompt and drafts as soon as its rows arrive) and answers its Propose; the same counts and
    # tokens come out without it.
    drafting = ROUNDS if accepted_per_round else sum(1 for r in range(MAX_NEW_TOKENS - 1, 0, -1) if r > 1)
    if draft_ahead == "0":
        assert info.drafted_ahead == 0 and parts["drafted_ahead"] == 0
    else:
        # A Propose that reaches the replica before its round's rows takes them itself (the two never race for them).
        assert 0 < info.drafted_ahead <= drafting
