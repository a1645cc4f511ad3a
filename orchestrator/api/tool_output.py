"""Tool calls on /v1/chat/completions: the served model's format, a request's forcing grammar, and its reply read
into content and `tool_calls`, whole or streamed as OpenAI streams them.

Parsing happens here, in the HTTP front end, on the detokenized reply: the scheduler and the target see a chat
with tools as any other request (a forced one carries its grammar). When the format's markers are special tokens
of the tokenizer (which plain text skips), the reply is decoded again from its token ids with those kept, and the
request's stop strings applied to that text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from orchestrator.api.openai_protocol import bad_field
from orchestrator.api.openai_responses import ResponseShape
from orchestrator.api.tool_formats import FORMATS, ToolFormat, detect_format
from orchestrator.api.tool_grammar import forced_functions, parameters_error, special_marker_ids, tool_grammar
from orchestrator.api.tool_request import ToolRequest
from orchestrator.api.tool_stream import Piece, ToolCall, ToolCallStream
from orchestrator.loop.output import Output
from orchestrator.loop.text import IncrementalDetokenizer, StopStringMatcher
from tandem.wire import orchestrator_pb2


class ChatTools:
    """The served model's tool-call format, read from its chat template (None: tools are rendered, never parsed)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None, parser: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.format: ToolFormat | None = detect_format(template, parser)
        self.special_ids = special_marker_ids(tokenizer, self.format) if self.format is not None else {}

    @property
    def arguments_as_text(self) -> bool:
        return self.format is not None and self.format.arguments_as_text

    def prepare(self, tools: ToolRequest, generate: orchestrator_pb2.GenerateRequest) -> None:
        """Refuses tools this model cannot call; gives a forced choice its grammar. Compiles schemas: run it off
        the event loop."""
        if not tools.parsed:
            return
        if self.format is None:
            known = ", ".join(tool_format.name for tool_format in FORMATS)
            raise bad_field("tools", f"the chat template writes no tool-call format Tandem reads ({known})")
        if not tools.forced:
            return
        functions = forced_functions(tools.tools, tools.named)
        for index, tool in enumerate(tools.tools):
            error = parameters_error(tool["function"]["parameters"]) if tool["function"]["name"] in functions else ""
            if error:
                raise bad_field(f"tools[{index}].function.parameters", error)
        parallel = tools.parallel and tools.choice == "required"  # a named function is called once, as OpenAI does
        generate.grammar = tool_grammar(self.format, functions, parallel, self.special_ids)

    def reply(self, tools: ToolRequest, prompt_ids: Sequence[int], stop: Sequence[str]) -> ToolReply | None:
        """The reader of a request's reply, or None when its calls are not parsed (tool_choice none)."""
        if not tools.parsed or self.format is None:
            return None
        if not self.special_ids:
            return ToolReply(ToolCallStream(self.format))
        kept = frozenset(self.special_ids.values())
        text = IncrementalDetokenizer(self.tokenizer, prompt_ids, kept)
        return ToolReply(ToolCallStream(self.format), text, StopStringMatcher(stop))


class ToolReply:
    """One request's reply read into content and tool calls."""

    def __init__(
        self,
        stream: ToolCallStream,
        text: IncrementalDetokenizer | None = None,
        stop: StopStringMatcher | None = None,
    ) -> None:
        self.stream = stream
        self._text = text  # None: the output's own text has every marker
        self._stop = stop

    def pieces(self, output: Output) -> list[Piece]:
        """The content and calls one output completes (all that is left, on the last one)."""
        pieces = self.stream.feed(self._text_of(output))
        if output.finish_reason:
            pieces += self.stream.finish()
        return pieces

    def finish_reason(self, reason: str) -> str:
        """`tool_calls` when the reply made calls and was not cut short by max_tokens."""
        return "tool_calls" if self.stream.calls and reason != "length" else reason

    def full(
        self, shape: ResponseShape, pieces: Sequence[Piece], reason: str, usage: Any, logprobs: Any
    ) -> dict[str, Any]:
        """The answer without stream: content (null when empty and there are calls) and `tool_calls`."""
        content = "".join(piece for piece in pieces if isinstance(piece, str))
        response = shape.full(content, self.finish_reason(reason), usage, logprobs)
        if self.stream.calls:
            message = response["choices"][0]["message"]
            message["content"] = content or None
            message["tool_calls"] = [call.body() for call in self.stream.calls]
        return response

    def chunks(
        self, shape: ResponseShape, output: Output, reason: str | None, first: bool, logprobs: Any
    ) -> list[dict[str, Any]]:
        """The chunks of one output: its content, then each call as two chunks (index, id and name with empty
        arguments; then the arguments), the output's logprobs on the first, the finish reason on the last."""
        chunks: list[dict[str, Any]] = []
        content: list[str] = []
        for piece in self.pieces(output):
            if isinstance(piece, str):
                content.append(piece)
                continue
            if content:
                chunks.append(shape.chunk("".join(content), None))
                content = []
            chunks += [_call_chunk(shape, piece, opening=True), _call_chunk(shape, piece, opening=False)]
        if content or not chunks:
            chunks.append(shape.chunk("".join(content), None))
        if first:
            chunks[0]["choices"][0]["delta"] = {"role": "assistant", **chunks[0]["choices"][0]["delta"]}
        chunks[0]["choices"][0]["logprobs"] = logprobs
        if reason:
            chunks[-1]["choices"][0]["finish_reason"] = self.finish_reason(reason)
        return chunks

    def _text_of(self, output: Output) -> str:
        if self._text is None or self._stop is None:
            return output.text
        text = self._text.push(output.token_ids)
        if output.finish_reason:
            text += self._text.flush()
        text, stopped = self._stop.feed(text)
        return text if stopped or not output.finish_reason else text + self._stop.flush()


def _call_chunk(shape: ResponseShape, call: ToolCall, opening: bool) -> dict[str, Any]:
    function: Mapping[str, str] = {"name": call.name, "arguments": ""} if opening else {"arguments": call.arguments}
    delta: dict[str, Any] = {"index": call.index, "function": function}
    if opening:
        delta.update(id=call.id, type="function")
    chunk = shape.chunk("", None)
    chunk["choices"][0]["delta"] = {"tool_calls": [delta]}
    return chunk
