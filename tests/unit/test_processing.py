"""A request's scored rows as its options make them (tandem.sampling.processing): each row counts its own path, so a
row's distribution is the same whether its path came as drafts or was committed token by token."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import process_rows

VOCAB = 12
PROMPT = [3, 4, 4, 9]
OPTIONS = [
    SamplingParams(min_tokens=4, stop_token_ids=(2, 11)),
    SamplingParams(logit_bias=((1, 5.0), (7, -100.0))),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingParams(
        presence_penalty=-1.5, frequency_penalty=2.0, repetition_penalty=0.8, logit_bias=((5, 3.0),), min_tokens=6,
        stop_token_ids=(0,),
    ),
]  # fmt: skip
TREES = [DraftTree(), DraftTree.chain([5, 5, 8, 1]), DraftTree.of([5, 6, 5, 5, 8], [-1, -1, 0, 1, 2])]


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # [rows, VOCAB]


@pytest.mark.parametrize("params", OPTIONS)
@pytest.mark.parametrize("tree", TREES)
def test_a_rows_path_counts_as_if_it_were_committed(params: SamplingParams, tree: DraftTree) -> None:
    """The property speculation's output rests on: row r processed with its path as drafts equals the same logits
    processed as the root row of a request that has committed that path."""
    tokens = [*PROMPT, 5, 10]
    rows = logits(1 + len(tree))
    processed = process_rows(rows, tree, params, tokens, len(PROMPT))
    for row, path in enumerate(tree.paths()):
        alone = process_rows(rows[row : row + 1], DraftTree(), params, [*tokens, *path], len(PROMPT))
        assert torch.equal(processed[row], alone[0]), (row, path)


def test_frequency_penalty_counts_new_tokens_and_the_path_as_the_docstring_says() -> None:
    params = SamplingParams(frequency_penalty=0.5)
    rows = torch.zeros(3, VOCAB)
    processed = process_rows(rows, DraftTree.chain([7, 5]), params, [*PROMPT, 5, 5], len(PROMPT))
    assert processed[:, 5].tolist() == [-1.0, -1.0, -1.5]
    assert processed[:, 7].tolist() == [0.0, -0.5, -0.5]
    assert processed[:, 4].tolist() == [0.0, 0.0, 0.0]  # prompt tokens do not count for OpenAI's penalties


def test_presence_penalty_and_logit_bias_follow_openai() -> None:
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=1.0, logit_bias=((3, 2.0), (5, -1.0)))
    rows = logits(1)
    processed = process_rows(rows, DraftTree(), params, [*PROMPT, 5, 5, 6], len(PROMPT))
    expected = rows.clone()
    expected[0, 3] += 2.0
    expected[0, 5] += -1.0 - 2 * 1.0 - 0.25
    expected[0, 6] += -1.0 - 0.25
    assert torch.allclose(processed, expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_is_transformers(penalty: float) -> None:
    tokens = [*PROMPT, 5, 1]
    rows = logits(1, seed=3)
    processed = process_rows(rows, DraftTree(), SamplingParams(repetition_penalty=penalty), tokens, len(PROMPT))
    reference = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), rows.clone())
    assert torch.allclose(processed, reference)


def test_stop_tokens_are_masked_in_rows_before_min_tokens_by_depth() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(3,))
    tree = DraftTree.of([0] * 5, [-1, -1, 0, 1, 1])  # depths 1, 1, 2, 2, 2
    processed = process_rows(torch.zeros(6, VOCAB), tree, params, [*PROMPT, 8], len(PROMPT))
    # One new token: rows of depth 0 and 1 decide tokens 2 and 3 of min_tokens 3; deeper rows come after.
    assert [bool(row[3].isneginf()) for row in processed] == [True, True, True, False, False, False]


def test_without_options_the_rows_are_returned_untouched() -> None:
    rows = logits(3)
    assert process_rows(rows, DraftTree.chain([1, 2]), SamplingParams(), PROMPT, len(PROMPT)) is rows
    past_min = SamplingParams(min_tokens=1, stop_token_ids=(2,))
    assert process_rows(rows, DraftTree.chain([1, 2]), past_min, [*PROMPT, 5], len(PROMPT)) is rows
    processed = process_rows(rows, DraftTree.chain([1, 2]), SamplingParams(presence_penalty=1.0), PROMPT, 4)
    assert processed is not rows and torch.equal(rows, logits(3))  # the input is left alone
