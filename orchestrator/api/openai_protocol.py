"""OpenAI's completion and chat completion requests and responses, translated to and from our own terms.

A request body becomes the public GenerateRequest that gRPC clients send (orchestrator.loop.generation runs both alike),
and outputs become OpenAI's JSON objects and streamed chunks. Every field the server cannot honour is refused with
400 naming it rather than ignored: n > 1, echo, suffix, best_of. Structured output: orchestrator/loop/structured.py;
tools: orchestrator/api/tool_request.py (and the tool_* modules beside it).
Fields that do not change the output (user, metadata, ...) are accepted and ignored, as vLLM does.

Defaults follow OpenAI, not the gRPC API: temperature 1.0 (gRPC: 0, greedy). max_tokens unset means the server's
default (--default-max-new-tokens), capped by the context.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.api.tool_request import ToolRequest, message_tool_fields, parse_tools
from orchestrator.loop.structured import FIELDS, from_openai
from orchestrator.loop.validation import InvalidRequest
from tandem.sampling.logprobs import MAX_TOP_LOGPROBS
from tandem.wire import orchestrator_pb2

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
UINT64_MAX = 2**64 - 1

# Fields that would change the output and that this server does not implement, with the value meaning "off".
UNSUPPORTED_UNLESS = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "functions": (None, []),
}


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_field(param: str, reason: str) -> ApiError:
    return ApiError(400, f"{param}: {reason}", param=param)


def from_invalid(error: InvalidRequest, prompt_field: str) -> ApiError:
    """The scheduler's refusal in OpenAI's field names (max_new_tokens is max_tokens; the prompt is the prompt or
    the chat's messages)."""
    field = error.field
    base, bracket, rest = field.partition("[")
    renamed = {
        "max_new_tokens": "max_tokens",
        "prompt": prompt_field,
        "input_ids": prompt_field,
        "json_schema": "response_format",
        "json_object": "response_format",
    }.get(base, base)
    param = renamed + bracket + rest
    return bad_field(param, str(error)[len(field) + 1 :].strip())


@dataclass(frozen=True)
class ImagePart:
    """An image_url part of a chat message: its URL, and where it stood (named in errors about it)."""

    url: str
    where: str


@dataclass(frozen=True)
class ParsedRequest:
    """A completion or chat request: what the scheduler runs, and how the answer is shaped."""

    generate: orchestrator_pb2.GenerateRequest  # for chat: everything but the prompt, which the template gives
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    chat: bool
    messages: tuple[Mapping[str, Any], ...] = ()  # chat only: role, text content (and tool calls) of each message
    tools: ToolRequest | None = None  # chat only
    images: tuple[ImagePart, ...] = ()  # chat only: its image_url parts, in order


def parse_completion(body: Mapping[str, Any], model_name: str) -> ParsedRequest:
    """POST /v1/completions."""
    generate = _common(body, model_name, "max_tokens")
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise bad_field(name, "tools are served on /v1/chat/completions only")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_field("prompt", "empty")
        generate.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_integer(token) for token in prompt):
        generate.input_ids.extend(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        raise bad_field("prompt", f"a batch of {len(prompt)} prompts; send one request per prompt")
    else:
        raise bad_field("prompt", "must be a non-empty string or a non-empty list of token ids")
    if body.get("top_logprobs") is not None:
        raise bad_field("top_logprobs", "not a completions field; logprobs: N asks for the N most likely tokens")
    top = _top_count(body, "logprobs")  # the legacy API's logprobs: N is how many best tokens per position
    if top is not None:
        generate.logprobs, generate.top_logprobs = True, top
    return ParsedRequest(generate, *_stream_options(body), chat=False)


def parse_chat(body: Mapping[str, Any], model_name: str) -> ParsedRequest:
    """POST /v1/chat/completions; the prompt is left to the chat template (orchestrator.api.chat)."""
    maximum = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    generate = _common(body, model_name, maximum)
    generate.logprobs = _boolean(body, "logprobs")
    top = _top_count(body, "top_logprobs")
    if top is not None:
        if not generate.logprobs:
            raise bad_field("top_logprobs", "needs logprobs: true")
        generate.top_logprobs = top
    try:
        tools = parse_tools(body, next((name for name in FIELDS if getattr(generate, name)), None))
    except ValueError as error:
        raise bad_field(*str(error).split(": ", 1)) from None
    messages, images = _messages(body.get("messages"))
    return ParsedRequest(generate, *_stream_options(body), True, messages, tools, images)


def _messages(messages: Any) -> tuple[tuple[Mapping[str, Any], ...], tuple[ImagePart, ...]]:
    """The messages as the chat template takes them, and the image_url parts among them in order."""
    if not isinstance(messages, list) or not messages:
        raise bad_field("messages", "must be a non-empty list of {role, content} objects")
    parsed = []
    images: list[ImagePart] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_field(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_field(f"{where}.role", "must be a non-empty string")
        try:
            tool_fields = message_tool_fields(message, role, where)
        except ValueError as error:
            raise bad_field(*str(error).split(": ", 1)) from None
        content = message.get("content")
        text = "" if content is None and "tool_calls" in tool_fields else _content(content, f"{where}.content", images)
        parsed.append({"role": role, "content": text, **tool_fields})
    return tuple(parsed), tuple(images)


MEDIA_PARTS = ("input_audio", "video_url", "file")  # content part types of media this server does not serve


def _content(content: Any, where: str, images: list[ImagePart]) -> str | list[dict[str, str]]:
    """A message's content as the chat template takes it: its text (a string, or text parts joined), or, where it
    holds images, its parts in order, each image a {"type": "image"} part whose URL joins `images`."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_field(where, "must be a string or a list of content parts")
    parts: list[dict[str, str]] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            images.append(ImagePart(_image_url(part, f"{where}[{index}]"), f"{where}[{index}]"))
            parts.append({"type": "image"})
        else:
            media = f"{kind!r} parts are not served; " if kind in MEDIA_PARTS else ""
            raise bad_field(
                f"{where}[{index}]", f'{media}content parts are {{"type": "text", "text": ...}} or image_url parts'
            )
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image_url(part: Mapping[str, Any], where: str) -> str:
    """An image_url part's URL: {"type": "image_url", "image_url": {"url": ...}} (or the URL as a string)."""
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, dict) else image
    if not isinstance(url, str) or not url:
        raise bad_field(f"{where}.image_url", 'must be {"url": "data:...", "http(s)://..." or "file://..."}')
    return url


def _common(body: Mapping[str, Any], model_name: str, max_tokens_field: str) -> orchestrator_pb2.GenerateRequest:
    """The sampling and stopping fields shared by both endpoints."""
    model = body.get("model")
    if model is not None and model != model_name:
        message = f"model: {model!r} is not served here; this server serves {model_name!r}"
        raise ApiError(404, message, "model", code="model_not_found")
    for name, off_values in UNSUPPORTED_UNLESS.items():
        if body.get(name) not in off_values:
            raise bad_field(name, f"not supported; leave it out or {_shown(off_values[-1])}")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_field("n", f"only 1 completion per request is supported, got {n!r}; send several requests")
    generate = orchestrator_pb2.GenerateRequest()
    max_tokens = _integer(body, max_tokens_field, minimum=1)
    if max_tokens is not None:
        generate.max_new_tokens = min(max_tokens, 2**31 - 1)
    temperature = _number(body, "temperature")
    generate.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = _number(body, "top_p")
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise bad_field("top_p", f"must be in (0, 1], got {top_p}")
        generate.top_p = top_p
    top_k = _integer(body, "top_k", minimum=-1)  # vLLM: -1 (or 0) disables it
    if top_k is not None and top_k > 0:
        generate.top_k = min(top_k, 2**31 - 1)
    seed = _integer(body, "seed", minimum=0)
    if seed is not None:
        if seed > UINT64_MAX:
            raise bad_field("seed", f"must be at most {UINT64_MAX}, got {seed}")
        generate.seed = seed  # 0 included: proto3 `optional` keeps its presence
    generate.stop.extend(_stop(body.get("stop")))
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, list) or not all(_is_integer(token) for token in stop_token_ids):
            raise bad_field("stop_token_ids", "must be a list of token ids")
        for index, token in enumerate(stop_token_ids):
            if not 0 <= token < 2**31:
                raise bad_field(f"stop_token_ids[{index}]", f"{token} is not a token id")
        generate.stop_token_ids.extend(stop_token_ids)
    generate.ignore_eos = _boolean(body, "ignore_eos")
    min_tokens = _integer(body, "min_tokens", minimum=0)
    if min_tokens is not None:
        generate.min_tokens = min(min_tokens, 2**31 - 1)
    generate.disable_speculation = _boolean(body, "disable_speculation")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str):
            raise bad_field("cache_salt", f"must be a string, got {_shown(salt)}")
        generate.cache_salt = salt
    _penalties(body, generate)
    try:
        from_openai(body, generate)
    except ValueError as error:
        field, _, reason = str(error).partition(": ")
        raise bad_field(field, reason) from None
    return generate


def _penalties(body: Mapping[str, Any], generate: orchestrator_pb2.GenerateRequest) -> None:
    """presence_penalty, frequency_penalty and logit_bias as OpenAI defines them, repetition_penalty as vLLM takes
    it; the ranges are checked with the gRPC request's (orchestrator.loop.validation)."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _number(body, name, signed=True)
        if value is not None:
            setattr(generate, name, value)
    if generate.repetition_penalty == 0.0 and body.get("repetition_penalty") is not None:
        raise bad_field("repetition_penalty", "must be above 0 (1: none), got 0")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad_field("logit_bias", f"must be an object of token ids to biases, got {_shown(bias)}")
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < 2**31:
            raise bad_field("logit_bias", f"{key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_field(f"logit_bias[{key}]", f"must be a finite number, got {_shown(value)}")
        generate.logit_bias[token] = float(value)


def _top_count(body: Mapping[str, Any], name: str) -> int | None:
    count = _integer(body, name, minimum=0)
    if count is not None and count > MAX_TOP_LOGPROBS:
        raise bad_field(name, f"at most {MAX_TOP_LOGPROBS}, got {count}")
    return count


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(item, str) for item in stop):
        raise bad_field("stop", "must be a string or a list of strings")
    return stop


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_field("stream_options", "only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad_field("stream_options", "must be an object")
    return stream, _boolean(options, "include_usage", "stream_options.include_usage")


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_integer(value):
        raise bad_field(name, f"must be an integer, got {_shown(value)}")
    if value < minimum:
        raise bad_field(name, f"must be at least {minimum}, got {value}")
    return int(value)


def _number(body: Mapping[str, Any], name: str, signed: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_field(name, f"must be a finite number, got {_shown(value)}")
    if value < 0 and not signed:
        raise bad_field(name, f"must be at least 0, got {value}")
    return float(value)


def _boolean(body: Mapping[str, Any], name: str, shown_as: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(shown_as or name, f"must be true or false, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return json.dumps(value)
