"""Resuming a broken stream (GenerateRequest.resume_token_ids): the tokens the client holds are taken as generated and
given, so that the rest of the stream is what the unbroken one would have sent, text and stop strings included; tokens
no stream could have sent are refused naming the first of them."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.output import RequestOutput, request_output
from orchestrator.loop.validation import InvalidRequest, Limits, validate_request
from tandem.wire import orchestrator_pb2
from tests.helpers.tokenizer import write_tokenizer
from tests.unit.test_request_output import messages

EOS = 2
ENDS = frozenset({EOS})
CODE = "value = compute(a, b) # done\nreturn value"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


def validated(tokenizer: PreTrainedTokenizerBase, **fields: object) -> orchestrator_pb2.GenerateRequest:
    request = orchestrator_pb2.GenerateRequest(input_ids=[50, 51, 52], **fields)  # type: ignore[arg-type]
    return validate_request(request, tokenizer, Limits(vocab_size=1000, max_context=256))


def output_of(tokenizer: PreTrainedTokenizerBase, **fields: object) -> RequestOutput:
    return request_output(validated(tokenizer, **fields), tokenizer, ENDS)


def streamed(output: RequestOutput, tokens: list[int], size: int) -> tuple[list[int], str, str]:
    """Emits `tokens` `size` at a time until the request ends; what its client got: tokens, text, finish reason."""
    given, text, finish = [], "", ""
    for start in range(0, len(tokens), size):
        output.emit(tokens[start : start + size], ENDS)
        for message in messages(output):
            given += message.token_ids
            text += message.text
            finish = message.finish_reason or finish
        if output.finished:
            break
    return given, text, finish


@pytest.mark.parametrize("stop", [(), ("# do",), ("e\nret",), ("lue =",)])
def test_a_resumed_stream_goes_on_exactly_where_the_broken_one_stopped(
    tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]
) -> None:
    ids = tokenizer.encode(CODE, add_special_tokens=False)
    fields = {"max_new_tokens": len(ids), "stop": stop}
    whole = streamed(output_of(tokenizer, **fields), ids, 2)
    resumes = 0
    for broken_after in range(1, len(ids)):  # the stream broke after this many messages
        first = output_of(tokenizer, **fields)
        given, text, finish = streamed(first, ids[: 2 * broken_after], 2)
        if finish:
            continue  # it had ended
        resumed = output_of(tokenizer, **fields, resume_token_ids=given)
        assert not messages(resumed)
        rest = streamed(resumed, ids[len(given) :], 2)
        assert (given + rest[0], text + rest[1], rest[2]) == whole, broken_after
        resumes += 1
    assert resumes >= 1


def test_tokens_that_ended_the_stream_leave_only_its_last_message(tokenizer: PreTrainedTokenizerBase) -> None:
    output = output_of(tokenizer, max_new_tokens=10, resume_token_ids=[60, 61, EOS])
    (message,) = messages(output)
    assert output.finished
    assert (message.token_ids, message.text, message.finish_reason, message.completion_tokens) == ([], "", "eos", 3)
    (length,) = messages(output_of(tokenizer, max_new_tokens=2, resume_token_ids=[60, 61]))
    assert (length.finish_reason, length.completion_tokens) == ("length", 2)


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"max_new_tokens": 10, "resume_token_ids": [60, EOS, 61]}, r"resume_token_ids\[2\]: .*ended.*\(eos\)"),
        ({"max_new_tokens": 10, "stop_token_ids": [61], "resume_token_ids": [61, 60]}, r"\[1\]: .*\(stop\)"),
        ({"max_new_tokens": 2, "resume_token_ids": [60, 61, 62]}, r"resume_token_ids: 3 tokens, more than .* = 2"),
        ({"max_new_tokens": 10, "resume_token_ids": [60, 5000]}, r"resume_token_ids\[1\]: 5000 is outside"),
        ({"max_new_tokens": 10, "choice": ["yes", "no"], "resume_token_ids": [60]}, r"\[0\]: the grammar does not"),
    ],
)
def test_tokens_no_stream_could_have_sent_are_refused(
    tokenizer: PreTrainedTokenizerBase, fields: dict[str, object], refused: str
) -> None:
    with pytest.raises(InvalidRequest, match=refused):
        output_of(tokenizer, **fields)


def test_tokens_the_grammar_allows_are_taken(tokenizer: PreTrainedTokenizerBase) -> None:
    yes = tokenizer.encode("yes", add_special_tokens=False)
    output = output_of(tokenizer, max_new_tokens=10, choice=["yes", "no"], resume_token_ids=yes[:1])
    assert output.generated == yes[:1] and output.completion_tokens == 1 and not output.finished
