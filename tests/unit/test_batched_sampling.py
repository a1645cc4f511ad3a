"""The batched device-side verification (tandem.sampling.batched) against the per-item rule, on the CPU.

Greedy items must give exactly what verify_greedy gives. Sampled items must commit tokens distributed as the target
distribution, checked with the chi-square test of tests/unit/test_sampling_lossless.py on its logits and drafts: a
batch of NUM_TRIALS items is one trial each, and two rounds commit at least two tokens per trial.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.models.registry import load_target
from tandem.sampling.batched import BatchSampling, batch_target_probs, verify_batch, verify_items
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import target_probs, verify_greedy
from tandem.settings import KVCacheSettings
from target_server.items import OpenRequest, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_sampling_lossless import (
    LIKELY_DRAFT,
    NUM_DRAFTS,
    NUM_TRIALS,
    PARAMS,
    SIGNIFICANCE,
    TARGET_LOGITS,
    UNLIKELY_DRAFT,
    chi_square_p_value,
    first_and_joint_p_values,
)

VOCAB = 11
PROMPT = [1, 40, 41, 42, 43, 44, 45]
OTHER_PARAMS = SamplingParams(temperature=1.3, top_p=0.8)


def greedy_case(seed: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Items with 0..4 drafts: a prefix of each item's drafts follows the row argmaxes, the rest is random."""
    generator = torch.Generator().manual_seed(seed)
    scored, drafts = [], []
    for num_drafts in (3, 0, 1, 4, 2, 4):
        logits = torch.randn(num_drafts + 1, VOCAB, generator=generator)
        choices = logits.argmax(dim=-1).tolist()
        agree = int(torch.randint(0, num_drafts + 1, (1,), generator=generator))
        random = torch.randint(0, VOCAB, (num_drafts,), generator=generator).tolist()
        scored.append(logits)
        drafts.append(choices[:agree] + random[agree:])
    return scored, drafts


@pytest.mark.parametrize("seed", range(6))
def test_greedy_items_match_verify_greedy(seed: int) -> None:
    scored, drafts = greedy_case(seed)
    outcomes = verify_items(scored, drafts, [SamplingParams()] * len(drafts))
    assert outcomes == [verify_greedy(logits, tokens) for logits, tokens in zip(scored, drafts, strict=True)]
    assert {outcome.accepted for outcome in outcomes} != {0}  # the case exercises acceptance


def test_greedy_items_beside_sampled_ones_are_unchanged() -> None:
    scored, drafts = greedy_case(seed=7)
    params = [SamplingParams() if index % 2 == 0 else PARAMS for index in range(len(drafts))]
    outcomes = verify_items(scored, drafts, params, torch.Generator().manual_seed(0))
    for index, outcome in enumerate(outcomes):
        if index % 2 == 0:
            assert outcome == verify_greedy(scored[index], drafts[index])
        assert len(outcome.tokens) == outcome.accepted + 1 and 0 <= outcome.accepted <= len(drafts[index])


def test_probabilities_match_target_probs_per_item() -> None:
    logits = torch.randn(3, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [PARAMS, OTHER_PARAMS, SamplingParams(temperature=0.5, top_k=3, top_p=0.9)]
    probs = batch_target_probs(logits, BatchSampling.of(params, torch.device("cpu")))
    for index, item_params in enumerate(params):
        torch.testing.assert_close(probs[index], target_probs(logits[index], item_params))


def first_two_tokens(drafts_per_position: list[int], params: SamplingParams, seed: int) -> torch.Tensor:
    """[NUM_TRIALS, 2]: the first two tokens committed by trials that draft from `drafts_per_position`, a batch of
    every trial per round (a trial that committed one token goes again from position 1)."""
    generator = torch.Generator().manual_seed(seed)
    sampling = BatchSampling.of([params] * NUM_TRIALS, torch.device("cpu"))
    committed = torch.full((NUM_TRIALS, NUM_DRAFTS + 2), -1)
    counts = torch.zeros(NUM_TRIALS, dtype=torch.long)
    for start in (0, 1):
        waiting = (counts < 2).nonzero().squeeze(1)
        assert bool((counts[waiting] == start).all())
        logits = TARGET_LOGITS[start : start + NUM_DRAFTS + 1].repeat(len(waiting), 1)  # [items * (k + 1), vocab]
        drafts = torch.tensor(drafts_per_position[start : start + NUM_DRAFTS]).repeat(len(waiting), 1)
        num_drafts = torch.full((len(waiting),), NUM_DRAFTS)
        subset = BatchSampling(sampling.temperature[waiting], sampling.top_k[waiting], sampling.top_p[waiting])
        result = verify_batch(logits, drafts, num_drafts, subset, generator)
        for row, (trial, accepted, token) in enumerate(
            zip(waiting.tolist(), result.accepted.tolist(), result.next_tokens.tolist(), strict=True)
        ):
            tokens = [*drafts[row, :accepted].tolist(), token]
            committed[trial, start : start + len(tokens)] = torch.tensor(tokens)
            counts[trial] += len(tokens)
    return committed[:, :2]


@pytest.mark.parametrize(
    "drafts", [pytest.param(LIKELY_DRAFT, id="likely"), pytest.param(UNLIKELY_DRAFT, id="unlikely")]
)
def test_committed_tokens_follow_the_target_distribution(drafts: list[int]) -> None:
    first_p_value, joint_p_value = first_and_joint_p_values(first_two_tokens(drafts, PARAMS, seed=1))
    assert first_p_value > SIGNIFICANCE
    assert joint_p_value > SIGNIFICANCE


def test_the_check_detects_sampling_from_other_parameters() -> None:
    """Negative control: tokens sampled with other parameters than those the check expects fail it."""
    first_p_value, _ = first_and_joint_p_values(first_two_tokens(LIKELY_DRAFT, OTHER_PARAMS, seed=1))
    assert first_p_value < SIGNIFICANCE


def test_each_item_samples_with_its_own_parameters() -> None:
    """Half the batch with PARAMS, half with OTHER_PARAMS, no drafts: each half's tokens follow its own p."""
    half = NUM_TRIALS // 2
    params = [PARAMS] * half + [OTHER_PARAMS] * half
    logits = TARGET_LOGITS[:1].repeat(2 * half, 1)  # [items, vocab], one row per item
    result = verify_batch(
        logits,
        torch.zeros((2 * half, 0), dtype=torch.long),
        torch.zeros(2 * half, dtype=torch.long),
        BatchSampling.of(params, torch.device("cpu")),
        torch.Generator().manual_seed(2),
    )
    assert bool((result.accepted == 0).all())
    for tokens, item_params in ((result.next_tokens[:half], PARAMS), (result.next_tokens[half:], OTHER_PARAMS)):
        expected = target_probs(TARGET_LOGITS[:1], item_params)[0].double()
        assert chi_square_p_value(torch.bincount(tokens, minlength=expected.numel()), expected) > SIGNIFICANCE


def run_steps(runner: TargetRunner, drafts: list[int]) -> list[tuple[int, list[int]]]:
    """Two requests opened in one step, then verified in one step with drafts (a greedy and a min_tokens one)."""
    opened = runner.step(
        [
            StepItem("a", len(PROMPT), open=OpenRequest(PROMPT, SamplingParams())),
            StepItem("b", len(PROMPT), open=OpenRequest(PROMPT, SamplingParams(min_tokens=3, stop_token_ids=(2,)))),
        ]
    )
    verified = runner.step([StepItem("a", 1, DraftTree.chain(drafts)), StepItem("b", 1, DraftTree.chain(drafts[:1]))])
    return [(result.accepted, result.new_tokens) for result in (*opened, *verified)]


def test_runner_verifying_in_batches_gives_the_same_greedy_tokens(tmp_path: Path) -> None:
    target = load_target(write_tiny_target(tmp_path, TinyTargetSpec()))
    cache = KVCacheSettings(num_blocks=64, block_size=4)
    decoder = TargetRunner(target, cache, max_context=64)
    decoder.prefill("a", PROMPT, SamplingParams())
    continuation = [decoder.verify("a").new_tokens[0] for _ in range(2)]  # greedy tokens 2 and 3
    drafts = [*continuation, (continuation[1] + 1) % 320]  # two right, then a wrong one
    per_item = TargetRunner(target, cache, max_context=64)
    batched = TargetRunner(target, cache, max_context=64, batched_verify=True)
    assert not per_item.batched_verify  # the CPU's default
    results = run_steps(batched, drafts)
    assert results == run_steps(per_item, drafts)
    assert results[2][0] == 2  # the right drafts were accepted
