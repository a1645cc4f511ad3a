"""Seeded sampling as a function of (seed, context, position) alone (tandem.sampling.verify, seeded_scores): the
committed tokens follow the target distribution (Pearson's chi-square, over seeds), and a seed gives the same tokens
whatever the drafts were, chain or tree, and with none at all; on a real runner, speculative equals target-only."""

from __future__ import annotations

import pytest
import torch

from draft_server.shaping import shape_logits
from tandem.models.llama import LlamaForCausalLM
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import Shaping
from tandem.sampling.tree_verify import verify_tree
from tandem.sampling.verify import make_generator, seeded_scores, target_probs, verify
from tandem.settings import KVCacheSettings
from target_server.items import TARGET_ONLY, OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_sampling_lossless import (
    LIKELY_DRAFT,
    NUM_DRAFTS,
    PARAMS,
    SIGNIFICANCE,
    TARGET_LOGITS,
    UNLIKELY_DRAFT,
    chi_square_p_value,
    first_and_joint_p_values,
)

NUM_SEEDS = 6_000


def first_two(seed: int, drafts: list[int] | None) -> list[int]:
    """The first two tokens a request with this seed commits, verifying `drafts[start:]` (None: none) each step."""
    params = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed)
    generator = make_generator(params)
    committed: list[int] = []
    while len(committed) < 2:
        start = len(committed)
        proposed = [] if drafts is None else drafts[start : start + NUM_DRAFTS]
        rows = TARGET_LOGITS[start : start + len(proposed) + 1]
        committed.extend(verify(rows, proposed, params, generator, None, position=start).tokens)
    return committed[:2]


@pytest.mark.parametrize("drafts", [None, LIKELY_DRAFT, UNLIKELY_DRAFT], ids=["no-drafts", "likely", "unlikely"])
def test_seeded_tokens_follow_the_target_distribution(drafts: list[int] | None) -> None:
    tokens = torch.tensor([first_two(seed, drafts) for seed in range(NUM_SEEDS)])
    first_p_value, joint_p_value = first_and_joint_p_values(tokens)
    assert first_p_value > SIGNIFICANCE
    assert joint_p_value > SIGNIFICANCE


def test_a_seed_gives_the_same_tokens_whatever_was_drafted() -> None:
    for seed in range(200):
        assert first_two(seed, LIKELY_DRAFT) == first_two(seed, UNLIKELY_DRAFT) == first_two(seed, None)


def test_the_check_sees_a_seeded_rule_keyed_without_the_position() -> None:
    # Keyed by the seed alone, both tokens would come from the same noise: the pair is then far from p_0 x p_1.
    def same_noise(seed: int) -> list[int]:
        params = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed)
        generator = make_generator(params)
        return [verify(TARGET_LOGITS[t : t + 1], [], params, generator, None, position=0).tokens[0] for t in (0, 1)]

    tokens = torch.tensor([same_noise(seed) for seed in range(3_000)])
    probs = target_probs(TARGET_LOGITS, PARAMS).double()
    joint = torch.bincount(tokens[:, 0] * probs.shape[1] + tokens[:, 1], minlength=probs.shape[1] ** 2)
    assert chi_square_p_value(joint, torch.outer(probs[0], probs[1]).flatten()) < SIGNIFICANCE


def test_a_tree_commits_the_seeds_tokens() -> None:
    # Children of the root: the unlikely and the likely token; under the likely one, the next likely token.
    tree = DraftTree((UNLIKELY_DRAFT[0], LIKELY_DRAFT[0], LIKELY_DRAFT[1]), (-1, -1, 1))
    rows = TARGET_LOGITS[[0, 1, 1, 2]]  # row 0: the root; row 1 + i: after node i (at depth 1, 1, 2)
    accepted = []
    for seed in range(200):
        params = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed)
        outcome = verify_tree(rows, tree, params, make_generator(params), position=0)
        decided = outcome.tokens[:2]  # the tokens of positions 0 and 1 it decided (1 when no node was accepted)
        assert decided == first_two(seed, None)[: len(decided)]
        accepted.append(outcome.accepted)
    assert set(accepted) == {0, 1, 2}  # rejected at the root, accepted at depth 1, and down to depth 2


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    return load_target(write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec()))


def seeded_tokens(target: LlamaForCausalLM, seed: int, drafts_of: list[int] | None, count: int) -> list[int]:
    """`count` tokens of a seeded request on a runner, each round verifying the next 3 of `drafts_of` (None: none)."""
    runner = TargetRunner(target, KVCacheSettings(num_blocks=16, block_size=4), max_context=64)
    sampling = SamplingParams(temperature=1.0, seed=seed)
    prompt = [1, 40, 41, 42, 43]
    (first,) = runner.step([StepItem("a", len(prompt), open=OpenRequest(prompt, sampling), stream=TARGET_ONLY)])
    tokens = list(first.new_tokens)
    while len(tokens) < count:
        drafts = [] if drafts_of is None else drafts_of[len(tokens) : len(tokens) + 3]
        (result,) = runner.step([StepItem("a", 1, DraftTree.chain(drafts))])
        tokens += result.new_tokens
    return tokens[:count]


def test_a_seeded_request_decodes_the_same_tokens_with_and_without_drafts(target: LlamaForCausalLM) -> None:
    for seed in (0, 7, 12345):
        alone = seeded_tokens(target, seed, None, 16)
        assert seeded_tokens(target, seed, alone, 16) == alone  # its own tokens as drafts: all accepted
        assert seeded_tokens(target, seed, [5] * 16, 16) == alone  # junk drafts: rejected, the same tokens
    assert seeded_tokens(target, 0, None, 16) != seeded_tokens(target, 1, None, 16)


def test_a_draft_with_the_targets_logits_drafts_the_seeds_own_tokens() -> None:
    """A seeded request's drafts are drawn with the noise of the target's rows (Shaping.row): a draft whose
    distribution were the target's would propose exactly the seed's tokens, so every draft would be accepted."""
    vocab = 64
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    prompt = (3, 9, 27)
    shaping = Shaping.of(params, len(prompt), prompt)
    assert shaping is not None  # seeded sampling alone is reason enough to shape the drafts
    drafted: list[int] = []
    for row in logits:
        drafted.append(int(shaping.row(row, drafted).argmax()))
    scores = seeded_scores(logits, params, [len(prompt) + depth for depth in range(len(logits))])
    assert drafted == scores.argmax(dim=-1).tolist()
    assert verify(logits, drafted[:-1], params, make_generator(params), None, position=len(prompt)).accepted == 11
    # Unseeded and greedy requests without other options are left as they are.
    assert Shaping.of(SamplingParams(temperature=0.8), 3, prompt) is None
    assert Shaping.of(SamplingParams(seed=7), 3, prompt) is None


def test_a_draft_vocabulary_of_its_own_never_proposes_an_id_outside_it() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    shaping = Shaping.of(params, 1, (0,))
    target_ids = torch.tensor([2, 5, 7])  # the draft's three columns, in the target's vocabulary of 10
    logits = torch.tensor([[0.0, -1.0, -2.0]])
    shaped = shape_logits(logits, [shaping], [[]], (target_ids, 10))
    scores = seeded_scores(torch.full((1, 10), float("-inf")).index_copy(1, target_ids, logits), params, [1])
    assert int(shaped.argmax()) == int(scores[:, target_ids].argmax())
    assert torch.isfinite(shaped).all()
