"""Acceptance rules and target filtering on hand-built logits."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import (
    VerifyOutcome,
    _residual_probs,
    make_generator,
    sample_token,
    target_probs,
    verify,
    verify_greedy,
    verify_sampled,
)

SAMPLED = SamplingParams(temperature=1.0)
NUM_SEEDS = 200


def logits_with_argmaxes(argmaxes: list[int], vocab_size: int = 6) -> torch.Tensor:  # [len(argmaxes), vocab_size]
    """Rows whose largest logit sits at the given tokens, with distinct runner-up values so nothing ties."""
    logits = torch.arange(vocab_size, dtype=torch.float32).repeat(len(argmaxes), 1) * 0.1
    logits[torch.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


def log_probs(probs: list[float]) -> torch.Tensor:  # [1, len(probs)]
    """Logits whose softmax at temperature 1 is probs."""
    return torch.tensor([probs]).log()


# Greedy verification. Row argmaxes [3, 1, 4, 0]: drafts are checked against 3, 1 and 4, and 0 is the bonus.


def test_greedy_accepts_every_matching_draft_and_appends_the_bonus() -> None:
    outcome = verify_greedy(logits_with_argmaxes([3, 1, 4, 0]), [3, 1, 4])
    assert outcome == VerifyOutcome(accepted=3, tokens=[3, 1, 4, 0])


@pytest.mark.parametrize(
    ("draft_tokens", "expected"),
    [
        pytest.param([2, 1, 4], VerifyOutcome(accepted=0, tokens=[3]), id="first"),
        pytest.param([3, 2, 4], VerifyOutcome(accepted=1, tokens=[3, 1]), id="middle"),
        pytest.param([3, 1, 2], VerifyOutcome(accepted=2, tokens=[3, 1, 4]), id="last"),
    ],
)
def test_greedy_replaces_the_first_mismatch_with_the_target_argmax(
    draft_tokens: list[int], expected: VerifyOutcome
) -> None:
    assert verify_greedy(logits_with_argmaxes([3, 1, 4, 0]), draft_tokens) == expected


def test_greedy_discards_drafts_after_the_first_mismatch_even_when_they_match() -> None:
    # Draft 2 equals the argmax of its row, but its parent (draft 1) was rejected.
    outcome = verify_greedy(logits_with_argmaxes([3, 1, 4, 0]), [3, 5, 4])
    assert outcome == VerifyOutcome(accepted=1, tokens=[3, 1])


def test_greedy_with_no_drafts_takes_the_argmax() -> None:
    assert verify_greedy(logits_with_argmaxes([2]), []) == VerifyOutcome(accepted=0, tokens=[2])


def test_verify_dispatches_greedy_params_to_greedy_and_ignores_draft_probs() -> None:
    logits = logits_with_argmaxes([3, 1, 4, 0])
    uniform_draft = torch.full((3, 6), 1 / 6)
    outcome = verify(logits, [3, 2, 4], SamplingParams(), make_generator(SamplingParams(seed=0)), uniform_draft)
    assert outcome == VerifyOutcome(accepted=1, tokens=[3, 1])


def test_sampled_rule_with_greedy_params_matches_greedy() -> None:
    # At temperature 0 the target distribution is one-hot, so the lossless rule must reduce to greedy verification.
    logits = logits_with_argmaxes([3, 1, 4, 0])
    for draft_tokens in ([3, 1, 4], [2, 1, 4], [3, 2, 4], [3, 1, 2]):
        for seed in range(5):
            sampled = verify_sampled(logits, draft_tokens, SamplingParams(), make_generator(SamplingParams(seed=seed)))
            assert sampled == verify_greedy(logits, draft_tokens)


# Target filtering: temperature, then top_k, then top_p.


def test_target_probs_at_temperature_one_is_the_softmax() -> None:
    probs = target_probs(log_probs([0.1, 0.2, 0.3, 0.4]), SAMPLED)
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))


def test_temperature_divides_the_logits() -> None:
    # Logits [0, ln 4] at temperature 2 become [0, ln 2]: probabilities [1/3, 2/3].
    probs = target_probs(torch.tensor([[0.0, math.log(4.0)]]), SamplingParams(temperature=2.0))
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 2 / 3]]))


def test_greedy_target_probs_are_one_hot_at_the_argmax() -> None:
    probs = target_probs(logits_with_argmaxes([3, 0]), SamplingParams())
    torch.testing.assert_close(probs, torch.eye(6)[[3, 0]])


def test_top_k_keeps_the_k_most_likely_tokens() -> None:
    probs = target_probs(log_probs([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    probs = target_probs(log_probs([0.4, 0.4, 0.2]), SamplingParams(temperature=1.0, top_k=1))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("top_k", [4, 100])
def test_top_k_at_or_above_the_vocabulary_size_keeps_everything(top_k: int) -> None:
    probs = target_probs(log_probs([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.2, 0.3, 0.4]]))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # Sorted [0.4, 0.3, 0.2, 0.1]: mass above each is [0, 0.4, 0.7, 0.9]; a token stays while that is < top_p.
        pytest.param(0.35, [0.0, 0.0, 0.0, 1.0], id="top-token-only"),
        pytest.param(0.5, [0.0, 0.0, 3 / 7, 4 / 7], id="two-tokens"),
        pytest.param(0.75, [0.0, 2 / 9, 3 / 9, 4 / 9], id="three-tokens"),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p: float, expected: list[float]) -> None:
    probs = target_probs(log_probs([0.1, 0.2, 0.3, 0.4]), SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([expected]))


def test_top_p_of_one_keeps_even_vanishing_tokens() -> None:
    logits = torch.tensor([[0.0, 30.0, 30.0]])  # token 0 has probability about 5e-14
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=1.0))
    assert 0.0 < float(probs[0, 0]) < 1e-12


def test_top_k_applies_before_top_p() -> None:
    # top_k = 3 renormalises to [0, 2/9, 3/9, 4/9]; mass above 2/9 is then 7/9 >= 0.75, so top_p drops it too.
    # In the other order top_p = 0.75 would keep three tokens (mass above 0.2 is 0.7) and top_k would keep them all.
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.75)
    probs = target_probs(log_probs([0.1, 0.2, 0.3, 0.4]), params)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))


def test_target_probs_filters_each_row_on_its_own() -> None:
    logits = torch.cat([log_probs([0.1, 0.2, 0.3, 0.4]), log_probs([0.4, 0.3, 0.2, 0.1])])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7], [4 / 7, 3 / 7, 0.0, 0.0]]))


def test_sample_token_never_picks_a_filtered_token() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    generator = make_generator(params)
    samples = {sample_token(log_probs([0.1, 0.2, 0.3, 0.4])[0], params, generator) for _ in range(NUM_SEEDS)}
    assert samples == {2, 3}


def test_sample_token_with_greedy_params_is_the_argmax() -> None:
    generator = make_generator(SamplingParams(seed=0))
    assert sample_token(log_probs([0.1, 0.2, 0.4, 0.3])[0], SamplingParams(), generator) == 2


# Sampled verification.


def test_sampled_verify_with_no_drafts_samples_from_row_zero() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    seen = set()
    for seed in range(NUM_SEEDS):
        outcome = verify_sampled(logits, [], SAMPLED, make_generator(SamplingParams(seed=seed)))
        assert outcome.accepted == 0
        assert len(outcome.tokens) == 1
        seen.add(outcome.tokens[0])
    assert seen == {0, 1}


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["deterministic-draft", "draft-probs"])
def test_draft_token_of_zero_target_probability_is_always_rejected(with_draft_probs: bool) -> None:
    # Row 0 rules out token 2 (top_k = 3 drops its logit, the lowest); the draft proposes exactly that token.
    logits = torch.tensor([[1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=3)
    draft_probs = torch.tensor([[0.1, 0.1, 0.7, 0.1]]) if with_draft_probs else None
    for seed in range(NUM_SEEDS):
        outcome = verify_sampled(logits, [2], params, make_generator(SamplingParams(seed=seed)), draft_probs)
        assert outcome.accepted == 0
        assert outcome.tokens[0] != 2


def test_draft_token_of_target_probability_one_is_always_accepted() -> None:
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf")], [0.0, 0.0, 0.0]])
    for seed in range(NUM_SEEDS):
        outcome = verify_sampled(logits, [1], SAMPLED, make_generator(SamplingParams(seed=seed)))
        assert outcome.accepted == 1
        assert outcome.tokens[0] == 1


def test_a_draft_that_matches_the_target_is_always_accepted() -> None:
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    draft_probs = target_probs(logits[:3], SAMPLED)  # q == p at every position: min(1, p/q) = 1
    draft_tokens = [0, 4, 2]
    for seed in range(NUM_SEEDS):
        outcome = verify_sampled(logits, draft_tokens, SAMPLED, make_generator(SamplingParams(seed=seed)), draft_probs)
        assert outcome.accepted == 3
        assert outcome.tokens[:3] == draft_tokens
        assert len(outcome.tokens) == 4


def test_the_residual_falls_back_to_the_target_when_p_equals_q() -> None:
    target_row = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(_residual_probs(target_row, 1, target_row.clone()), target_row)


def test_the_residual_is_the_normalised_excess_of_p_over_q() -> None:
    # p - q = [0.3, -0.1, -0.2] -> max(., 0) = [0.3, 0, 0]; a one-hot q at token 1 leaves p without token 1.
    target_row = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(_residual_probs(target_row, 1, torch.tensor([0.2, 0.4, 0.4])), torch.eye(3)[0])
    torch.testing.assert_close(_residual_probs(target_row, 1, None), torch.tensor([5 / 7, 0.0, 2 / 7]))


def test_outcome_always_holds_the_accepted_drafts_and_one_more_token() -> None:
    draft_tokens = [1, 3, 0]
    # Each draft token gets logit 1.5 against 0 for the other four: p = 0.53, so every acceptance count shows up.
    logits = torch.zeros(4, 5)
    logits[torch.arange(3), draft_tokens] = 1.5
    accepted_counts = set()
    for seed in range(NUM_SEEDS):
        outcome = verify_sampled(logits, draft_tokens, SAMPLED, make_generator(SamplingParams(seed=seed)))
        assert outcome.tokens[: outcome.accepted] == draft_tokens[: outcome.accepted]
        assert len(outcome.tokens) == outcome.accepted + 1
        accepted_counts.add(outcome.accepted)
    assert accepted_counts == {0, 1, 2, 3}


def test_equal_seeds_give_equal_outcomes() -> None:
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    draft_probs = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(3)), dim=-1)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1234)

    def run(generator: torch.Generator) -> list[VerifyOutcome]:
        return [verify_sampled(logits, [1, 3, 0], params, generator, draft_probs) for _ in range(50)]

    first_run = run(make_generator(params))
    assert run(make_generator(params)) == first_run
    assert run(make_generator(SamplingParams(seed=4321))) != first_run


def test_shape_mismatches_are_rejected() -> None:
    generator = make_generator(SamplingParams(seed=0))
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(torch.zeros(2, 5), [1, 2])
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampled(torch.zeros(3, 5), [1, 2], SAMPLED, generator, torch.full((2, 4), 0.25))


def test_a_draft_token_outside_its_own_distribution_is_rejected_as_input() -> None:
    draft_probs = torch.tensor([[0.5, 0.5, 0.0]])
    with pytest.raises(ValueError, match="zero probability"):
        verify_sampled(torch.zeros(2, 3), [2], SAMPLED, make_generator(SamplingParams(seed=0)), draft_probs)


# Parameters.


@pytest.mark.parametrize(
    "make_params",
    [
        pytest.param(lambda: SamplingParams(temperature=-0.1), id="negative-temperature"),
        pytest.param(lambda: SamplingParams(top_p=0.0), id="zero-top-p"),
        pytest.param(lambda: SamplingParams(top_p=1.5), id="top-p-above-one"),
        pytest.param(lambda: SamplingParams(top_k=-1), id="negative-top-k"),
    ],
)
def test_invalid_params_are_refused(make_params: Callable[[], SamplingParams]) -> None:
    with pytest.raises(ValueError):
        make_params()


def test_only_temperature_zero_is_greedy() -> None:
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_a_seeded_generator_repeats_and_an_unseeded_one_does_not() -> None:
    seeded = SamplingParams(seed=7)
    assert torch.equal(torch.rand(8, generator=make_generator(seeded)), torch.rand(8, generator=make_generator(seeded)))
    unseeded = SamplingParams()
    assert not torch.equal(
        torch.rand(8, generator=make_generator(unseeded)), torch.rand(8, generator=make_generator(unseeded))
    )
