"""Per-request sampling parameters (torch-free, so the orchestrator can import them cheaply)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target model's logits.

    The filters apply in the order temperature, top_k, top_p (the order of Hugging Face transformers and vLLM).
    """

    temperature: float = 0.0  # 0 => greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p; in (0, 1]
    top_k: int = 0  # keep the top_k most likely tokens; 0 => disabled
    seed: int | None = None  # None => nondeterministic
    # Until min_tokens new tokens exist, the ids that would end the request (EOS unless ignored, stop token ids) are
    # masked out of every distribution the target samples or verifies from, greedy included.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # Applied to every row the target samples or verifies from, before temperature, each row counting the tokens of
    # its own path (tandem.sampling.processing): OpenAI's presence and frequency penalties over the new tokens,
    # transformers' repetition penalty over prompt and new tokens, and OpenAI's logit_bias (token id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0 => none
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: llguidance's grammar text ("" : none); the target masks each row by it (sampling/grammar.py).
    grammar: str = ""

    def __post_init__(self) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")

    @property
    def processes_rows(self) -> bool:
        """Whether rows need more than the min_tokens mask: penalties or a bias."""
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        return penalized or bool(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_seeded(self) -> bool:
        """Sampled with a seed: its tokens are the Gumbel-max form keyed by (seed, position) (sampling/verify.py)."""
        return self.seed is not None and not self.is_greedy
