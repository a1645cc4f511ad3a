"""Gemma 4's notation for a call's arguments, read into JSON values.

Gemma 4's template writes arguments as `{key:value,...}`: keys bare, strings between `<|"|>` markers, numbers,
true/false/null, lists and objects as in JSON: `{city:<|"|>Paris<|"|>,days:[1,2],metric:true}`. JSON itself
(quoted keys and strings) reads the same, which is what the grammar of a forced call writes.
"""

from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
BARE = re.compile(r"[A-Za-z0-9_\-.$]+")
LITERALS = {"true": True, "false": False, "null": None}


def gemma_value(text: str) -> Any:
    """The value `text` writes (an object, for a call's arguments); raises ValueError when it is malformed."""
    reader = _Reader(text)
    value = reader.value()
    reader.skip_space()
    if reader.position != len(text):
        raise ValueError(f"unexpected text at {reader.position}")
    return value


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0

    def skip_space(self) -> None:
        while self.position < len(self.text) and self.text[self.position].isspace():
            self.position += 1

    def expect(self, piece: str) -> None:
        self.skip_space()
        if not self.text.startswith(piece, self.position):
            raise ValueError(f"expected {piece!r} at {self.position}")
        self.position += len(piece)

    def peek(self, piece: str) -> bool:
        self.skip_space()
        return self.text.startswith(piece, self.position)

    def value(self) -> Any:
        if self.peek("{"):
            return self.mapping()
        if self.peek("["):
            return self.sequence()
        if self.peek(QUOTE) or self.peek('"'):
            return self.string()
        match = BARE.match(self.text, self.position)
        if match is None:
            raise ValueError(f"no value at {self.position}")
        self.position = match.end()
        word = match.group()
        if word in LITERALS:
            return LITERALS[word]
        try:
            return json.loads(word)
        except json.JSONDecodeError:
            raise ValueError(f"{word!r} is not a value") from None

    def string(self) -> str:
        if self.peek(QUOTE):
            end = self.text.find(QUOTE, self.position + len(QUOTE))
            if end < 0:
                raise ValueError("unterminated string")
            start, self.position = self.position + len(QUOTE), end + len(QUOTE)
            return self.text[start:end]
        value, self.position = json.JSONDecoder().raw_decode(self.text, self.position)
        return str(value)

    def key(self) -> str:
        if self.peek(QUOTE) or self.peek('"'):
            return self.string()
        match = BARE.match(self.text, self.position)
        if match is None:
            raise ValueError(f"no key at {self.position}")
        self.position = match.end()
        return match.group()

    def mapping(self) -> dict[str, Any]:
        self.expect("{")
        result: dict[str, Any] = {}
        while not self.peek("}"):
            if result:
                self.expect(",")
            key = self.key()
            self.expect(":")
            result[key] = self.value()
        self.expect("}")
        return result

    def sequence(self) -> list[Any]:
        self.expect("[")
        result: list[Any] = []
        while not self.peek("]"):
            if result:
                self.expect(",")
            result.append(self.value())
        self.expect("]")
        return result
