"""What a user already runs: Hugging Face transformers `generate` on the same target checkpoint, batch 1.

Two methods, both greedy and forced to the benchmark's token budget (no end-of-sequence token, `min_new_tokens` =
`max_new_tokens`): plain `generate`, and prompt-lookup assisted generation, which drafts by matching the last tokens
against the prompt (no draft model). The model is loaded with AutoModelForCausalLM in the benchmark's dtype, with
SDPA attention and transformers' default DynamicCache, and runs one prompt at a time on the calling thread, so it
uses that thread's intra-op (OpenMP) threads (bench.main gives them the target service's count).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.harness import RequestResult, RunResult


class Method(Enum):
    GREEDY = "transformers greedy"
    PROMPT_LOOKUP = "transformers prompt-lookup"

    @property
    def label(self) -> str:
        """The setup name in the report's rows."""
        return self.value

    @property
    def speculative(self) -> bool:
        """Prompt lookup drafts tokens and verifies them; plain greedy does not."""
        return self is Method.PROMPT_LOOKUP


@dataclass(frozen=True)
class TransformersSettings:
    target_dir: Path
    dtype: str
    prompt_lookup_num_tokens: int  # tokens drafted per lookup (transformers' `prompt_lookup_num_tokens`)


class TransformersBaseline:
    """The target in transformers, generating greedy completions of a fixed length one prompt at a time."""

    def __init__(self, settings: TransformersSettings) -> None:
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(str(settings.target_dir))
        self.model = AutoModelForCausalLM.from_pretrained(
            str(settings.target_dir), dtype=getattr(torch, settings.dtype), attn_implementation="sdpa"
        ).eval()

    def complete(self, prompt: str, max_new_tokens: int, method: Method) -> tuple[int, ...]:
        """The completion's token ids; the prompt is tokenized as Tandem's orchestrator does (special tokens added)."""
        input_ids = torch.tensor([self.tokenizer.encode(prompt, add_special_tokens=True)])  # [1, prompt_tokens]
        extra = {"prompt_lookup_num_tokens": self.settings.prompt_lookup_num_tokens} if method.speculative else {}
        with torch.inference_mode():
            output = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=self.tokenizer.pad_token_id,
                **extra,
            )  # [1, prompt_tokens + max_new_tokens]
        completion = tuple(int(token) for token in output[0, input_ids.shape[1] :])
        self.tokenizer.decode(list(completion))  # a user reads text; Tandem's rates include detokenizing too
        return completion

    def run(self, prompts: Sequence[str], max_new_tokens: int, method: Method) -> RunResult:
        """Every prompt in turn (batch 1, sequential); wall time covers the whole set, tokenizing included.

        The result has no rounds or per-phase times (transformers reports none): those fields are zero, and the
        first token's time is the whole completion's, since `generate` returns it all at once.
        """
        requests = []
        progress = tqdm(total=len(prompts), desc=f"{method.label} c=1")
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            request_started = time.perf_counter()
            completion = self.complete(prompt, max_new_tokens, method)
            latency = time.perf_counter() - request_started
            requests.append(_request_result(index, completion, latency))
            progress.update()
        wall = time.perf_counter() - started
        progress.close()
        return RunResult(method.label, method.speculative, 1, wall, tuple(requests))


def _request_result(prompt_index: int, completion: tuple[int, ...], latency: float) -> RequestResult:
    return RequestResult(
        prompt_index=prompt_index,
        token_ids=completion,
        completion_tokens=len(completion),
        rounds=0,
        draft_tokens=0,
        accepted_tokens=0,
        accepted_per_position=(),
        latency_seconds=latency,
        first_token_seconds=latency,
    )
