"""Turning generated token ids into streamed text: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# Decoding yields this character for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHARACTER = "\ufffd"
# Prompt ids decoded in front of the first generated ids, so that their text comes out as it would mid-sequence.
PROMPT_CONTEXT_IDS = 5
# Ids held back at most while the text ends in REPLACEMENT_CHARACTER. A UTF-8 character has at most 4 bytes and a
# token at least one, so only ids that decode to nothing (skipped special tokens) could keep a real character
# incomplete for longer; past this bound the trailing character is invalid bytes or a literal U+FFFD, and holding
# it back would stall the stream and grow the window without end.
MAX_PENDING_IDS = 16


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id decoding skips as special: the added tokens marked special and the named ones (BOS, EOS, ...)."""
    added = {index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(added.union(tokenizer.all_special_ids))


class IncrementalDetokenizer:
    """Text of generated ids, produced piece by piece without re-decoding the whole output at every step.

    A tokenizer's text for an id can depend on its neighbours: a byte-level token may hold only part of a UTF-8
    character (decoded alone it gives U+FFFD), and SentencePiece drops the leading space of the first token of a
    sequence. So new text is taken as a difference: decode the window [prefix ids + pending ids], decode the prefix
    ids alone, and emit what the first has beyond the second. The prefix is the chunk emitted last (at the start,
    the last PROMPT_CONTEXT_IDS prompt ids); it ends on a character boundary, so the difference is exact. When the
    window's text ends in U+FFFD the pending ids are held back, as the next ids may complete the character. After
    an emission the pending ids become the prefix and older ids are dropped, so the cost of a step does not grow
    with the length of the output.

    Worked example, prompt "Hello" (one id), then "é" (the two byte tokens C3 and A9), then " world":

        push([C3])        window [Hello | C3]      decodes "Hello\ufffd": ends incomplete, emit ""
        push([A9])        window [Hello | C3 A9]   decodes "Helloé", prefix "Hello": emit "é"
                          window becomes [C3 A9 |]
        push([ world])    window [C3 A9 | world]   decodes "é world", prefix "é": emit " world"
                          window becomes [ world |]

    Special tokens are skipped: they mark structure (end of sequence, turns), they are not text for the client;
    except `kept` ones, which a reader of the text needs (the tool-call markers of a family that makes them special
    tokens, orchestrator.api.tool_output).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int], kept: frozenset[int] = frozenset()
    ) -> None:
        self._tokenizer = tokenizer
        self._skipped: frozenset[int] = frozenset()
        if kept:
            self._skipped = special_token_ids(tokenizer) - kept
        self._kept = kept
        self._window = list(prompt_ids[-PROMPT_CONTEXT_IDS:])
        # The window is self._window[:self._read_index] (prefix, already emitted) + the rest (pending).
        self._read_index = len(self._window)

    def push(self, token_ids: Sequence[int]) -> str:
        """Takes newly generated ids; returns the text they complete, possibly "" while a character is incomplete."""
        self._window.extend(token_ids)
        pending_count = len(self._window) - self._read_index
        if pending_count == 0:
            return ""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHARACTER) and pending_count < MAX_PENDING_IDS:
            return ""
        return self._release(text)

    def flush(self) -> str:
        """At the end of generation: the text held back, even if its last character is incomplete."""
        if len(self._window) == self._read_index:
            return ""
        return self._release(self._decode(self._window))

    def _release(self, window_text: str) -> str:
        prefix_text = self._decode(self._window[: self._read_index])
        self._window = self._window[self._read_index :]
        self._read_index = len(self._window)
        return window_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        # Cleanup rewrites spaces around punctuation depending on the neighbours, which would break the difference.
        if self._kept:
            token_ids = [token for token in token_ids if token not in self._skipped]
        text = self._tokenizer.decode(token_ids, skip_special_tokens=not self._kept, clean_up_tokenization_spaces=False)
        # A flat id list decodes to one string; the declared union also covers batches.
        assert isinstance(text, str)
        return text


class StopStringMatcher:
    """Cuts streamed text at the first occurrence of any stop string, which may span several chunks.

    Text that could be the beginning of a stop string is held back until the next chunk shows whether it is. The
    stop string itself is never emitted. Once stopped, further text is discarded.

    Example with stop ["###"]: feed("a #") -> ("a ", False), holding "#"; feed("#") -> ("", False), holding "##";
    feed("#b") -> ("", True). Had the last chunk been "x", it would give ("##x", False).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not stop_string for stop_string in stop):
            raise ValueError("stop strings must be non-empty: an empty one would match before any text")
        self._stop = tuple(stop)
        self._longest = max((len(stop_string) for stop_string in self._stop), default=0)
        self._held = ""
        self._stopped = False

    @property
    def strings(self) -> tuple[str, ...]:
        return self._stop

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found)."""
        if self._stopped:
            return "", True
        buffer = self._held + text
        stop_index = min(
            (index for index in (buffer.find(stop_string) for stop_string in self._stop) if index >= 0),
            default=-1,
        )
        if stop_index >= 0:
            self._held = ""
            self._stopped = True
            return buffer[:stop_index], True
        emit_length = len(buffer) - self._partial_match_length(buffer)
        self._held = buffer[emit_length:]
        return buffer[:emit_length], False

    def flush(self) -> str:
        """When generation ends for another reason: the held-back text, which turned out not to be a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_match_length(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that begins a stop string (buffer holds no whole stop string)."""
        for start in range(max(0, len(buffer) - self._longest + 1), len(buffer)):
            suffix = buffer[start:]
            if any(stop_string.startswith(suffix) for stop_string in self._stop):
                return len(buffer) - start
        return 0
