"""A grammar text checked without a tokenizer or torch: the orchestrator refuses a request whose grammar does not
compile before the target masks anything with it (tandem.sampling.grammar), and its process imports no torch."""

from __future__ import annotations

from functools import lru_cache

import llguidance


@lru_cache(maxsize=256)
def grammar_error(grammar: str) -> str:
    """What is wrong with a grammar text ("" if nothing), without a tokenizer."""
    return str(llguidance.LLMatcher.validate_grammar(grammar))
