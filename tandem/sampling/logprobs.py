"""Log probabilities of committed tokens, as the target reports them (torch-free, so the orchestrator can import it).

What is reported is the raw model distribution: log_softmax of the target's logits for the row that chose the token,
before temperature, top-k, top-p and min_tokens masking (OpenAI's meaning, and vLLM's default "raw_logprobs"). A
token that came from an accepted draft gets the logprob of the row that verified it, the same row that would have
chosen it without speculation, so the values do not depend on whether a draft was used.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # most likely tokens one request may ask for per position (vLLM's default max_logprobs)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the most likely tokens of its row, best first
