"""A request's output side: stop token ids end it like EOS (but ignore_eos does not skip them), and its latencies."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.output import Output, RequestOutput
from orchestrator.text import IncrementalDetokenizer, StopStringMatcher
from tests.helpers.tokenizer import write_tokenizer

EOS = 2


@pytest.fixture
def tokenizer(tmp_path: Path) -> PreTrainedTokenizerBase:
    write_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def request_output(
    tokenizer: PreTrainedTokenizerBase, stop_token_ids: frozenset[int] = frozenset(), ignore_eos: bool = False
) -> RequestOutput:
    return RequestOutput(
        prompt_tokens=3,
        max_new_tokens=10,
        ignore_eos=ignore_eos,
        detokenizer=IncrementalDetokenizer(tokenizer, [50, 51, 52]),
        stop=StopStringMatcher(()),
        stop_token_ids=stop_token_ids,
    )


def last_message(output: RequestOutput) -> Output:
    message = None
    while not output.messages.empty():
        message = output.messages.get_nowait()
    assert isinstance(message, Output)
    return message


def test_a_stop_token_ends_the_request_and_is_kept(tokenizer: PreTrainedTokenizerBase) -> None:
    output = request_output(tokenizer, stop_token_ids=frozenset({70}), ignore_eos=True)
    output.emit([60, EOS, 70, 80], frozenset({EOS}))
    message = last_message(output)
    assert message.finish_reason == "stop"
    assert message.token_ids == [60, EOS, 70]  # EOS ignored, the stop token kept, what follows dropped
    assert output.finished and output.generated == [60, EOS, 70]


def test_latencies_are_recorded_per_message(tokenizer: PreTrainedTokenizerBase) -> None:
    output = request_output(tokenizer)
    output.mark_scheduled()
    output.mark_scheduled()  # admitted again after a preemption: the queue time stays the first one
    queue_seconds = output.stats.queue_seconds
    output.emit([60], frozenset({EOS}))
    output.emit([61, 62], frozenset({EOS}))
    output.emit([EOS], frozenset({EOS}))
    stats = last_message(output).stats
    assert stats is not None
    assert stats.queue_seconds == queue_seconds >= 0.0
    assert len(stats.inter_token_seconds) == 2
    assert 0.0 <= stats.first_token_seconds <= stats.total_seconds
