"""Logprobs in OpenAI's two shapes, from the TokenLogprobs of a request's messages (tandem.sampling.logprobs).

Completions (the legacy shape): {"tokens": [text], "token_logprobs": [float], "top_logprobs": [{text: float}],
"text_offset": [int]}, where text_offset is where each token's text starts in the completion. Chat:
{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}. A token's text is the
tokenizer's decoding of that token alone, so a token holding part of a multi-byte character shows as U+FFFD; its
`bytes` are those of that text in UTF-8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from tandem.sampling.logprobs import TokenLogprob


class LogprobShaper:
    """Shapes the logprobs of one response; streamed chunks are shaped one after another (text offsets go on)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.offset = 0  # characters of the completion's token texts shaped so far
        self._texts: dict[int, str] = {}

    def shape(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._chat(logprobs) if self.chat else self._completion(logprobs)

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = str(self.tokenizer.decode([token_id]))
        return self._texts[token_id]

    def _completion(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens = [self.text(entry.token_id) for entry in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in logprobs],
            "top_logprobs": [{self.text(token): logprob for token, logprob in entry.top} for entry in logprobs],
            "text_offset": offsets,
        }

    def _chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._chat_token(entry.token_id, entry.logprob),
                    "top_logprobs": [self._chat_token(token, logprob) for token, logprob in entry.top],
                }
                for entry in logprobs
            ]
        }

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
