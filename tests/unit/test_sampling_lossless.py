"""Statistical check that speculative sampling is lossless: committed tokens follow the target distribution.

The target logits depend on the position only, never on the prefix, so the token at position j must follow
p_j = target_probs(TARGET_LOGITS)[j] and the first two committed tokens must be jointly distributed as p_0 x p_1,
whatever the draft proposes. Each trial runs the decoding loop (draft NUM_DRAFTS tokens, verify, commit, start again
after the committed tokens) until two tokens are committed. Pearson's chi-square test compares the counts with the
expected ones; its p-value is the chi-square survival function, the regularised upper incomplete gamma function,
which torch provides, so scipy is not needed. Every run is seeded, so a result does not change between runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import process_rows
from tandem.sampling.verify import VerifyOutcome, sample_token, target_probs, verify_sampled

NUM_DRAFTS = 2
# Enough for at least 20 expected counts in every possible cell of the first-two-tokens table (the rule of thumb
# for the chi-square approximation asks for 5), while the file runs in about 10 s on a quiet 2-core machine.
NUM_TRIALS = 12_000
# The lossy rules below move the distributions so far that 3,000 trials give chi-square statistics above 200,
# against thresholds of 20.5 (5 degrees of freedom) and 66.6 (35) at the 0.001 level.
NUM_CONTROL_TRIALS = 3_000
SIGNIFICANCE = 0.001

# top_k = 6 of a 7-token vocabulary gives every position one token the target cannot emit (probability 0), which
# the drafts below propose on purpose.
PARAMS = SamplingParams(temperature=0.8, top_k=6)

# A trial's second step starts at position 1 at the latest and reads rows 1 .. NUM_DRAFTS + 1, hence four rows.
TARGET_LOGITS = torch.tensor(  # [NUM_DRAFTS + 2, vocab]
    [
        [1.2, 0.0, 0.6, -0.5, 0.3, -2.0, 0.9],
        [-0.3, 1.0, -2.5, 0.5, 0.1, 0.7, -0.6],
        [0.4, -0.8, 0.9, 0.0, -3.0, 0.6, 0.2],
        [-1.5, 0.3, 0.0, 1.1, 0.5, -0.4, 0.8],
    ]
)

# Draft tokens per position 0 .. NUM_DRAFTS; test_drafts_propose_what_their_names_say checks these claims.
LIKELY_DRAFT = [0, 1, 2]  # the target's most likely token at each position
UNLIKELY_DRAFT = [3, 2, 1]  # rare tokens, and at position 1 one the target cannot emit

# Deliberately unlike the target, with mass on the tokens the target cannot emit.
DRAFT_PROBS = torch.tensor(  # [NUM_DRAFTS + 1, vocab]
    [
        [0.05, 0.25, 0.10, 0.30, 0.05, 0.15, 0.10],
        [0.30, 0.05, 0.15, 0.10, 0.20, 0.05, 0.15],
        [0.10, 0.30, 0.05, 0.20, 0.15, 0.10, 0.10],
    ]
)

# Given the position of the first draft and a generator: the draft tokens, and the q they were sampled from
# (None for a deterministic draft).
DraftProposer = Callable[[int, torch.Generator], tuple[list[int], torch.Tensor | None]]
VerifyRule = Callable[
    [torch.Tensor, Sequence[int], SamplingParams, torch.Generator, torch.Tensor | None], VerifyOutcome
]


def deterministic_draft(tokens_per_position: list[int]) -> DraftProposer:
    def propose(start: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
        return tokens_per_position[start : start + NUM_DRAFTS], None

    return propose


def sampled_draft(probs_per_position: torch.Tensor) -> DraftProposer:  # [positions, vocab]
    def propose(start: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor | None]:
        draft_probs = probs_per_position[start : start + NUM_DRAFTS]  # [NUM_DRAFTS, vocab]
        tokens = torch.multinomial(draft_probs, 1, generator=generator).squeeze(1)  # [NUM_DRAFTS]
        return tokens.tolist(), draft_probs

    return propose


def accept_every_draft(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,  # [k, vocab]
) -> VerifyOutcome:
    """Wrong on purpose: the output follows the draft, not the target."""
    bonus = sample_token(target_logits[-1], params, generator)
    return VerifyOutcome(accepted=len(draft_tokens), tokens=[*draft_tokens, bonus])


def resample_from_target_on_rejection(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None,  # [k, vocab]
) -> VerifyOutcome:
    """Wrong on purpose, and a common bug: the correction comes from p instead of norm(max(p - q, 0))."""
    outcome = verify_sampled(target_logits, draft_tokens, params, generator, draft_probs)
    if outcome.accepted == len(draft_tokens):
        return outcome
    correction = sample_token(target_logits[outcome.accepted], params, generator)
    return VerifyOutcome(accepted=outcome.accepted, tokens=[*outcome.tokens[:-1], correction])


def first_two_tokens(rule: VerifyRule, propose: DraftProposer, num_trials: int, seed: int) -> torch.Tensor:
    """[num_trials, 2]: the first two tokens each trial commits, drafting afresh at every step as a decoder would."""
    generator = torch.Generator().manual_seed(seed)
    trials = []
    for _ in range(num_trials):
        committed: list[int] = []
        while len(committed) < 2:
            start = len(committed)
            draft_tokens, draft_probs = propose(start, generator)
            target_logits = TARGET_LOGITS[start : start + NUM_DRAFTS + 1]  # [NUM_DRAFTS + 1, vocab]
            committed.extend(rule(target_logits, draft_tokens, PARAMS, generator, draft_probs).tokens)
        trials.append(committed[:2])
    return torch.tensor(trials)


def chi_square_p_value(
    counts: torch.Tensor,  # [cells]
    expected_probs: torch.Tensor,  # [cells]
) -> float:
    """Probability, if the counts were drawn from expected_probs, of a chi-square statistic at least this large."""
    possible = expected_probs > 0
    # A single count in a cell of probability 0 is impossible under expected_probs.
    if counts[~possible].sum() > 0:
        return 0.0
    observed = counts[possible].double()
    expected = expected_probs[possible].double() * counts.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = torch.tensor((observed.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(degrees_of_freedom, statistic / 2))


def first_and_joint_p_values(tokens: torch.Tensor) -> tuple[float, float]:  # tokens: [num_trials, 2]
    """p-values of the first token against p_0 and of the pair against p_0 x p_1 (pair (a, b): cell a * vocab + b)."""
    probs = target_probs(TARGET_LOGITS, PARAMS).double()  # [positions, vocab]
    vocab_size = probs.shape[1]
    first_counts = torch.bincount(tokens[:, 0], minlength=vocab_size)
    joint_counts = torch.bincount(tokens[:, 0] * vocab_size + tokens[:, 1], minlength=vocab_size * vocab_size)
    joint_probs = torch.outer(probs[0], probs[1]).flatten()
    return chi_square_p_value(first_counts, probs[0]), chi_square_p_value(joint_counts, joint_probs)


def test_drafts_propose_what_their_names_say() -> None:
    probs = target_probs(TARGET_LOGITS, PARAMS)
    assert probs[: NUM_DRAFTS + 1].argmax(dim=-1).tolist() == LIKELY_DRAFT
    unlikely_probs = [float(probs[position, token]) for position, token in enumerate(UNLIKELY_DRAFT)]
    assert unlikely_probs[1] == 0.0
    assert all(prob < 0.05 for prob in unlikely_probs)
    assert bool((DRAFT_PROBS[probs[: NUM_DRAFTS + 1] == 0] > 0).all())


@pytest.mark.parametrize(
    "propose",
    [
        pytest.param(deterministic_draft(LIKELY_DRAFT), id="deterministic-likely"),
        pytest.param(deterministic_draft(UNLIKELY_DRAFT), id="deterministic-unlikely"),
        pytest.param(sampled_draft(DRAFT_PROBS), id="sampled-from-q"),
    ],
)
def test_committed_tokens_follow_the_target_distribution(propose: DraftProposer) -> None:
    tokens = first_two_tokens(verify_sampled, propose, NUM_TRIALS, seed=1)
    first_p_value, joint_p_value = first_and_joint_p_values(tokens)
    assert first_p_value > SIGNIFICANCE
    assert joint_p_value > SIGNIFICANCE


@pytest.mark.parametrize(
    ("rule", "propose"),
    [
        pytest.param(accept_every_draft, sampled_draft(DRAFT_PROBS), id="accept-every-draft"),
        pytest.param(resample_from_target_on_rejection, sampled_draft(DRAFT_PROBS), id="resample-from-target"),
    ],
)
def test_the_check_detects_a_lossy_rule(rule: VerifyRule, propose: DraftProposer) -> None:
    """Negative control: the check above has the power to catch a wrong verification rule."""
    tokens = first_two_tokens(rule, propose, NUM_CONTROL_TRIALS, seed=1)
    first_p_value, joint_p_value = first_and_joint_p_values(tokens)
    assert first_p_value < SIGNIFICANCE
    assert joint_p_value < SIGNIFICANCE


# With penalties, a bias and a path-dependent mask (a stand-in for a grammar: no token twice in a row), a row's
# distribution depends on the tokens before it; each verified row is processed with its own draft path
# (tandem.sampling.processing), so the pair must follow p_0(a) x p_1(b | a), each processed with the committed prefix.
PROCESSED_PARAMS = SamplingParams(
    temperature=0.8,
    top_k=6,
    presence_penalty=0.8,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias=((2, 1.0),),
)
PROCESSED_PROMPT = [4, 4, 6]


def processed_logits(start: int, committed: Sequence[int], tree: DraftTree) -> torch.Tensor:  # [1 + len(tree), V]
    tokens = [*PROCESSED_PROMPT, *committed]
    paths = tree.paths()
    allowed = torch.ones(len(paths), TARGET_LOGITS.shape[1], dtype=torch.bool)
    for row, path in enumerate(paths):
        allowed[row, [*tokens, *path][-1]] = False  # no token twice in a row
    rows = TARGET_LOGITS[start : start + len(paths)]
    return process_rows(rows, tree, PROCESSED_PARAMS, tokens, len(PROCESSED_PROMPT), allowed)


def processed_first_two(num_trials: int, seed: int) -> torch.Tensor:  # [num_trials, 2]
    generator = torch.Generator().manual_seed(seed)
    propose = sampled_draft(DRAFT_PROBS)
    trials = []
    for _ in range(num_trials):
        committed: list[int] = []
        while len(committed) < 2:
            draft_tokens, draft_probs = propose(len(committed), generator)
            logits = processed_logits(len(committed), committed, DraftTree.chain(draft_tokens))
            outcome = verify_sampled(logits, draft_tokens, PROCESSED_PARAMS, generator, draft_probs)
            committed.extend(outcome.tokens)
        trials.append(committed[:2])
    return torch.tensor(trials)


def test_processed_rows_keep_speculative_sampling_lossless() -> None:
    vocab = TARGET_LOGITS.shape[1]
    first = target_probs(processed_logits(0, [], DraftTree()), PROCESSED_PARAMS)[0].double()  # [vocab]
    second = torch.stack(
        [
            target_probs(processed_logits(1, [token], DraftTree()), PROCESSED_PARAMS)[0].double()
            for token in range(vocab)
        ]
    )  # [vocab (first token), vocab]
    assert not torch.allclose(second[0], second[1])  # the second token's distribution depends on the first
    tokens = processed_first_two(NUM_TRIALS // 2, seed=3)
    joint_counts = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    joint_probs = (first.unsqueeze(1) * second).flatten()
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab), first) > SIGNIFICANCE
    assert chi_square_p_value(joint_counts, joint_probs) > SIGNIFICANCE
    # The check has power here: pairs drawn as if the first token had not been generated would be refused.
    assert chi_square_p_value(joint_counts, torch.outer(first, second[PROCESSED_PROMPT[-1]]).flatten()) < SIGNIFICANCE
