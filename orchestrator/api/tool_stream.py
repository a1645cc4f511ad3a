"""A reply's text split, as it streams, into content and tool calls (the format: orchestrator.api.tool_formats).

Content streams until the format's `begin` marker; text that may be the start of that marker is held back until
the next text decides. From the marker on, each call is given once its closing marker has arrived (bare JSON
calls, which have none, when the reply ends). A call that does not parse stops the reading: it and the rest of the
reply are given as content when the reply ends, so malformed output reaches the client as text, never lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from orchestrator.api.tool_formats import ParsedCall, ToolFormat


@dataclass(frozen=True)
class ToolCall:
    """A call as the client gets it: arguments are a JSON object's text."""

    index: int
    id: str
    name: str
    arguments: str

    def body(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = str | ToolCall  # content text, or a whole call


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Feed it the reply's text piece by piece, then finish it; each returns the pieces it completes, in order."""

    def __init__(self, tool_format: ToolFormat) -> None:
        self.format = tool_format
        self.calls: list[ToolCall] = []
        self._held = ""  # content that may begin the marker (before the calls) or the calls' unread text
        self._in_calls = False
        self._content_only = False  # an at_start format whose reply did not start with calls
        self._failed = False

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        if self._content_only:
            return self._release()
        if not self._in_calls:
            pieces = self._content()
            if not self._in_calls:
                return pieces
            return pieces + self._delimited_calls()
        return self._delimited_calls()

    def finish(self) -> list[Piece]:
        """The reply ended: its last calls, and whatever text is left as content."""
        if not self._in_calls:
            return self._release()
        pieces: list[Piece] = []
        if not self.format.call_end:
            pieces += self._bare_calls()
        else:
            pieces += self._delimited_calls()
        rest = self._held
        for marker in self.format.section:
            rest = rest.replace(marker, "") if marker and not self._failed else rest
        self._held = ""
        if rest.strip():
            pieces.append(rest if self._failed or not self.calls else rest.strip())
        return pieces

    def _release(self) -> list[Piece]:
        text, self._held = self._held, ""
        return [text] if text else []

    def _content(self) -> list[Piece]:
        """Content up to the marker; at the marker the calls start."""
        begin = self.format.begin
        if self.format.at_start:
            stripped = self._held.lstrip()
            if not stripped:
                return []
            if stripped.startswith(begin):
                self._in_calls, self._held = True, stripped
                return []
            self._content_only = True
            return self._release()
        found = self._held.find(begin)
        if found >= 0:
            content, self._held = self._held[:found], self._held[found:]
            self._in_calls = True
            return [content] if content else []
        sizes = range(min(len(begin) - 1, len(self._held)), 0, -1)
        keep = next((size for size in sizes if begin.startswith(self._held[-size:])), 0)  # may begin the marker
        content, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return [content] if content else []

    def _delimited_calls(self) -> list[Piece]:
        """The calls whose closing marker has arrived; the text after the last one stays held."""
        pieces: list[Piece] = []
        tool_format = self.format
        while not self._failed:
            start = self._held.find(tool_format.call_begin)
            end = self._held.find(tool_format.call_end, start + len(tool_format.call_begin)) if start >= 0 else -1
            if end < 0:
                break
            parsed = tool_format.parse_call(self._held[start + len(tool_format.call_begin) : end])
            if parsed is None:
                self._failed = True
                break
            pieces.append(self._call(parsed))
            self._held = self._held[end + len(tool_format.call_end) :]
        return pieces

    def _bare_calls(self) -> list[Piece]:
        """JSON objects one after another, separated by the format's separator (Llama 3.x)."""
        pieces: list[Piece] = []
        decoder = json.JSONDecoder()
        separator = self.format.separator.strip()
        while self._held.strip():
            text = self._held.lstrip()
            if self.calls and separator and text.startswith(separator):
                text = text[len(separator) :].lstrip()
            try:
                _, end = decoder.raw_decode(text)
            except json.JSONDecodeError:
                self._failed = True
                break
            parsed = self.format.parse_call(text[:end])
            if parsed is None:
                self._failed = True
                break
            pieces.append(self._call(parsed))
            self._held = text[end:]
        return pieces

    def _call(self, parsed: ParsedCall) -> ToolCall:
        call = ToolCall(len(self.calls), parsed.id or call_id(), parsed.name, parsed.arguments)
        self.calls.append(call)
        return call
