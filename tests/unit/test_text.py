"""Incremental detokenization, stop strings, and the test tokenizer they run on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.text import MAX_PENDING_IDS, PROMPT_CONTEXT_IDS, IncrementalDetokenizer, StopStringMatcher
from tests.helpers.tokenizer import BOS_TOKEN, EOS_TOKEN, write_tokenizer

VOCAB_SIZE = 320
CODE = 'def add(a, b):\n    """Adds."""\n    return a + b\n\n\nclass Point:\n    x: int = 0\n'


@pytest.fixture
def tokenizer(tmp_path: Path) -> PreTrainedTokenizerBase:
    write_tokenizer(tmp_path, VOCAB_SIZE)
    return AutoTokenizer.from_pretrained(tmp_path)


def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """The whole sequence decoded at once, the reference for streamed text."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert isinstance(text, str)
    return text


def stream(detokenizer: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    """The pieces of text emitted for each pushed chunk, then the flushed rest."""
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]


# The test tokenizer


def test_tokenizer_round_trips_text_and_names_its_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    for text in (CODE, "The quick brown fox.\n\tTabbed  double  spaces ~!@#$%^&*()", " leading and trailing "):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer) <= VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS_TOKEN, EOS_TOKEN)
    # Merges were learned: common code is shorter in tokens than in bytes.
    assert len(tokenizer.encode(CODE)) < len(CODE.encode()) * 0.8


def test_tokenizer_is_the_same_on_every_run(tmp_path: Path) -> None:
    write_tokenizer(tmp_path / "first")
    write_tokenizer(tmp_path / "second")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "first" / name).read_bytes() == (tmp_path / "second" / name).read_bytes()


# IncrementalDetokenizer


def test_detokenizer_streams_text_one_token_at_a_time(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt_ids = tokenizer.encode("Question: ")
    output_ids = tokenizer.encode(CODE)
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), [[token_id] for token_id in output_ids])
    assert "".join(pieces) == CODE
    # ASCII tokens are whole characters, so nothing is held back.
    assert pieces[:-1] == [tokenizer.decode([token_id]) for token_id in output_ids]
    assert pieces[-1] == ""


@pytest.mark.parametrize("character", ["é", "€", "😀"], ids=["2-bytes", "3-bytes", "4-bytes"])
def test_detokenizer_holds_back_an_incomplete_character(tokenizer: PreTrainedTokenizerBase, character: str) -> None:
    # The corpus is ASCII, so every byte of a non-ASCII character is its own token.
    character_ids = tokenizer.encode(character)
    assert len(character_ids) == len(character.encode())
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("A"))
    pieces = [detokenizer.push([token_id]) for token_id in character_ids]
    assert pieces == [""] * (len(character_ids) - 1) + [character]
    assert detokenizer.push(tokenizer.encode(" ok")) == " ok"


def test_flush_releases_an_incomplete_character_as_a_replacement(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("A"))
    assert detokenizer.push(tokenizer.encode("x€")[:-1]) == ""
    assert detokenizer.flush() == "x\ufffd"
    assert detokenizer.flush() == ""


def test_ids_beyond_the_tokenizer_and_special_tokens_decode_to_nothing(tokenizer: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.push([len(tokenizer), VOCAB_SIZE + 50]) == ""
    assert detokenizer.push([tokenizer.eos_token_id, *tokenizer.encode("hi")]) == "hi"


def test_a_literal_replacement_character_is_not_held_back_forever(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "\ufffd" * 20
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    pieces = stream(detokenizer, [[token_id] for token_id in tokenizer.encode(text)])
    assert "".join(pieces) == text
    assert len(pieces[MAX_PENDING_IDS - 1]) > 0


@pytest.mark.parametrize("seed", range(6))
def test_window_decoding_equals_decoding_the_whole_sequence(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    """Random ids cut characters anywhere, hold invalid bytes, special tokens and ids beyond the tokenizer."""
    generator = random.Random(seed)
    prompt_ids = tokenizer.encode("Once upon a time")
    output_ids = [generator.randrange(VOCAB_SIZE + 8) for _ in range(300)]
    chunks = []
    start = 0
    while start < len(output_ids):
        # Speculative rounds push several ids at once, sometimes none.
        size = generator.randrange(0, 6)
        chunks.append(output_ids[start : start + size])
        start += size
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), chunks)
    prompt_text = decode(tokenizer, prompt_ids)
    whole_text = decode(tokenizer, prompt_ids + output_ids)
    assert whole_text.startswith(prompt_text)
    assert "".join(pieces) == whole_text[len(prompt_text) :]


def test_detokenizer_decodes_a_bounded_window(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded_lengths = []
    original_decode = tokenizer.decode

    def recording_decode(token_ids: list[int], **kwargs: bool) -> str | list[str]:
        decoded_lengths.append(len(token_ids))
        return original_decode(token_ids, **kwargs)

    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(CODE))
    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    output_ids = tokenizer.encode(CODE * 10)
    pieces = [detokenizer.push([token_id]) for token_id in output_ids]
    assert "".join(pieces) == CODE * 10
    # The first push decodes the prompt context too; after that a window is the last id and the new one.
    assert max(decoded_lengths) <= PROMPT_CONTEXT_IDS + 1
    assert max(decoded_lengths[2:]) <= 2


# StopStringMatcher


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[tuple[str, bool]], str]:
    return [matcher.feed(chunk) for chunk in chunks], matcher.flush()


def test_no_stop_strings_pass_text_through() -> None:
    results, rest = feed_all(StopStringMatcher([]), ["a", "#", ""])
    assert results == [("a", False), ("#", False), ("", False)]
    assert rest == ""


def test_stop_string_within_one_chunk_cuts_the_text_before_it() -> None:
    results, rest = feed_all(StopStringMatcher(["\n\n"]), ["one\n", "two\n\nthree"])
    assert results == [("one", False), ("\ntwo", True)]
    assert rest == ""


def test_stop_string_spanning_chunks_is_held_back_and_never_emitted() -> None:
    results, rest = feed_all(StopStringMatcher(["###"]), ["a #", "#", "#b", "more"])
    assert results == [("a ", False), ("", False), ("", True), ("", True)]
    assert rest == ""


def test_held_back_text_is_released_when_it_is_not_a_stop_string() -> None:
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("a ##") == ("a ", False)
    assert matcher.feed("x#") == ("##x", False)
    assert matcher.flush() == "#"


def test_earliest_stop_string_wins() -> None:
    assert StopStringMatcher(["END", "cd"]).feed("abcdEND") == ("ab", True)
    # The longer stop string starts first, though the shorter one ends first.
    assert StopStringMatcher(["bc", "abcd"]).feed("xabcd") == ("x", True)


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("seed", range(10))
def test_any_chunking_gives_the_text_up_to_the_first_stop_string(seed: int) -> None:
    generator = random.Random(seed)
    stop = ["aba", "bb", "cab c"]
    text = "".join(generator.choice("abc ") for _ in range(60))
    first_stop = min((index for index in (text.find(s) for s in stop) if index >= 0), default=len(text))
    chunks = []
    start = 0
    while start < len(text):
        size = generator.randrange(0, 5)
        chunks.append(text[start : start + size])
        start += size
    results, rest = feed_all(StopStringMatcher(stop), chunks)
    assert "".join(emitted for emitted, _ in results) + rest == text[:first_stop]
    assert results[-1][1] == (first_stop < len(text))
