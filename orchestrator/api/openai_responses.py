"""OpenAI's response objects: a whole answer, streamed chunks, the usage, and their server-sent event framing."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.loop.output import Output

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def usage_of(output: Output) -> Usage:
    """The usage of a request's last message (the one with its stats)."""
    cached = output.stats.cached_tokens if output.stats is not None else 0
    return Usage(output.prompt_tokens, output.completion_tokens, cached)


class ResponseShape:
    """Builds the objects of one response: its id, creation time and model are the same in every chunk.

    The id is `cmpl-` (chat: `chatcmpl-`) and the request's client id (orchestrator.loop.validation.client_request_id).
    """

    def __init__(self, chat: bool, model_name: str, request_id: str, include_usage: bool = False) -> None:
        self.chat = chat
        self.include_usage = include_usage  # then every chunk has "usage": null, and the last one the usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model_name

    def _envelope(self, kind: str, choices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": list(choices)}

    def full(
        self, text: str, finish_reason: str, usage: Usage, logprobs: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The answer of a request without stream; logprobs shaped by orchestrator.api.openai_logprobs, or None."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            response = self._envelope(
                "chat.completion", [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}]
            )
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            response = self._envelope("text_completion", [choice])
        response["usage"] = usage.body()
        return response

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool = False,
        logprobs: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk; a chat's first chunk also names the role."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            chunk = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            chunk = self._envelope("text_completion", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage.body()}


def server_sent_event(data: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object (OpenAI's stream framing; the stream ends with DONE)."""
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
