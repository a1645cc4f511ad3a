"""What a tokenizer makes of a text, importable where torch is absent (the orchestrator's process)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def outcome(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], str] | str:
    """The ids and their text, or the error (a declared class that does not fit these files fails alike)."""
    try:
        ids = tokenizer.encode(text)
        return ids, tokenizer.decode(ids)
    except Exception as error:
        return repr(error)
