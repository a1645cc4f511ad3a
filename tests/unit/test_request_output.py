"""A request's output side: stop token ids end it like EOS (but ignore_eos does not skip them), the tokens a stop
string leaves, and its latencies."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.output import Output, RequestOutput
from orchestrator.loop.text import IncrementalDetokenizer, StopStringMatcher
from tandem.sampling.logprobs import TokenLogprob
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


CODE = "value = compute(a, b) # done\nreturn value"


def stopping_output(tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], max_new_tokens: int) -> RequestOutput:
    return RequestOutput(
        prompt_tokens=3,
        max_new_tokens=max_new_tokens,
        ignore_eos=False,
        detokenizer=IncrementalDetokenizer(tokenizer, [50, 51, 52]),
        stop=StopStringMatcher(stop),
    )


def messages(output: RequestOutput) -> list[Output]:
    queued = []
    while not output.messages.empty():
        message = output.messages.get_nowait()
        assert isinstance(message, Output)
        queued.append(message)
    return queued


@pytest.mark.parametrize("stop", ["lue =", "# do", "e\nret", "not in the text"])
@pytest.mark.parametrize("round_sizes", [[100], [1], [2, 3], [5, 1, 4], [3]])
def test_after_a_stop_string_the_tokens_end_with_the_last_one_whose_text_precedes_it(
    tokenizer: PreTrainedTokenizerBase, stop: str, round_sizes: list[int]
) -> None:
    ids = tokenizer.encode(CODE, add_special_tokens=False)
    starts = [len(tokenizer.decode(ids[:index])) for index in range(len(ids))]  # where each token's text starts
    cut = CODE.find(stop)
    expected = [token for token, start in zip(ids, starts, strict=True) if cut < 0 or start < cut]
    output = stopping_output(tokenizer, (stop, "never"), max_new_tokens=len(ids))
    position = 0
    given_tokens: list[int] = []
    given_text = ""
    for size in itertools.cycle(round_sizes):
        chunk = ids[position : position + size]
        position += len(chunk)
        output.emit(chunk, frozenset({EOS}), [TokenLogprob(token, -1.0, ()) for token in chunk])
        for message in messages(output):
            assert [entry.token_id for entry in message.logprobs] == message.token_ids  # logprobs go with tokens
            given_tokens += message.token_ids
            given_text += message.text
            assert message.completion_tokens == len(given_tokens)
            if not message.finish_reason:
                # Given: exactly the tokens whose text starts in the text given so far.
                assert len(tokenizer.decode(given_tokens[:-1])) < len(given_text) or not given_tokens
                assert len(tokenizer.decode(given_tokens)) >= len(given_text)
        if output.finished:
            break
    assert given_text == (CODE[:cut] if cut >= 0 else CODE)
    assert given_tokens == expected
    assert output.completion_tokens == len(expected)
    assert output.generated == ids[:position]  # the scheduler's view keeps every committed token


def test_a_stop_string_at_the_first_character_leaves_no_token(tokenizer: PreTrainedTokenizerBase) -> None:
    output = stopping_output(tokenizer, ("val",), max_new_tokens=20)
    output.emit(tokenizer.encode(CODE, add_special_tokens=False)[:4], frozenset({EOS}))
    (message,) = messages(output)
    assert (message.text, message.token_ids, message.finish_reason, message.completion_tokens) == ("", [], "stop", 0)
