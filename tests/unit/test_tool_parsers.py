"""Each family's tool-call format read from a reply, whole and streamed in small pieces: content before a call,
several calls, and malformed output left as content."""

from __future__ import annotations

import json

import pytest

from orchestrator.api.tool_formats import DEEPSEEK_V3, GEMMA4, HERMES, KIMI_K2, LLAMA3_JSON, ToolFormat, detect_format
from orchestrator.api.tool_gemma import gemma_value
from orchestrator.api.tool_stream import Piece, ToolCall, ToolCallStream

CITY = {"city": "Oslo", "days": [1, 2], "metric": True}


def read(tool_format: ToolFormat, text: str, size: int) -> tuple[str, list[tuple[str, dict[str, object]]], list[Piece]]:
    """Content, calls (name, arguments) and every piece of `text` fed `size` characters at a time."""
    stream = ToolCallStream(tool_format)
    pieces: list[Piece] = []
    for start in range(0, len(text), size):
        pieces += stream.feed(text[start : start + size])
    pieces += stream.finish()
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    calls = [(piece.name, json.loads(piece.arguments)) for piece in pieces if isinstance(piece, ToolCall)]
    assert [piece.index for piece in pieces if isinstance(piece, ToolCall)] == list(range(len(calls)))
    return content, calls, pieces


def hermes(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def deepseek(name: str, arguments: object) -> str:
    return (
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{json.dumps(arguments)}\n```<｜tool▁call▁end｜>"
    )


def kimi(name: str, arguments: object, index: int) -> str:
    arguments_text = json.dumps(arguments)
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{arguments_text}<|tool_call_end|>"


def gemma(name: str) -> str:
    return f'<|tool_call>call:{name}{{city:<|"|>Oslo<|"|>,days:[1,2],metric:true}}<tool_call|>'


CASES = [
    (HERMES, "Let me look.\n" + hermes("weather", CITY) + "\n" + hermes("time", {}), "Let me look.\n"),
    (
        LLAMA3_JSON,
        json.dumps({"name": "weather", "parameters": CITY}) + "; " + json.dumps({"name": "time", "parameters": {}}),
        "",
    ),
    (
        DEEPSEEK_V3,
        "Let me look.<｜tool▁calls▁begin｜>"
        + deepseek("weather", CITY)
        + "\n"
        + deepseek("time", {})
        + "<｜tool▁calls▁end｜>",
        "Let me look.",
    ),
    (
        KIMI_K2,
        "Let me look.<|tool_calls_section_begin|>"
        + kimi("weather", CITY, 0)
        + kimi("time", {}, 1)
        + "<|tool_calls_section_end|>",
        "Let me look.",
    ),
    (GEMMA4, "Let me look." + gemma("weather") + "<|tool_call>call:time{}<tool_call|>", "Let me look."),
]


@pytest.mark.parametrize(("tool_format", "text", "content"), CASES, ids=lambda case: getattr(case, "name", ""))
@pytest.mark.parametrize("size", [1, 2, 7, 10_000])
def test_calls_are_read_whole_and_streamed(tool_format: ToolFormat, text: str, content: str, size: int) -> None:
    read_content, calls, pieces = read(tool_format, text, size)
    assert read_content == content
    assert calls == [("weather", CITY), ("time", {})]
    if size < len(content):  # content streams before the calls are complete
        assert isinstance(pieces[0], str) and pieces[0] and content.startswith(pieces[0])


def test_kimi_calls_keep_their_own_ids() -> None:
    _, _, pieces = read(KIMI_K2, CASES[3][1], 5)
    assert [piece.id for piece in pieces if isinstance(piece, ToolCall)] == ["functions.weather:0", "functions.time:1"]


def test_made_ids_are_distinct() -> None:
    _, _, pieces = read(HERMES, CASES[0][1], 3)
    ids = [piece.id for piece in pieces if isinstance(piece, ToolCall)]
    assert len(set(ids)) == 2 and all(call_id.startswith("call_") for call_id in ids)


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        (HERMES, "Plain text, a < sign and <tool_ but no call."),
        (HERMES, "Before <tool_call>\n{not json}\n</tool_call> after"),
        (HERMES, 'Cut short <tool_call>\n{"name": "weather", "argu'),
        (LLAMA3_JSON, "It is sunny."),
        (LLAMA3_JSON, '{"city": "Oslo"}'),  # JSON, but not a call
        (
            DEEPSEEK_V3,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n{}<｜tool▁call▁end｜>",
        ),
        (KIMI_K2, "<|tool_calls_section_begin|><|tool_call_begin|>weather<|tool_call_end|>"),
        (GEMMA4, "<|tool_call>call:weather{city:}<tool_call|>"),
    ],
)
@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_malformed_output_is_left_as_content(tool_format: ToolFormat, text: str, size: int) -> None:
    content, calls, _ = read(tool_format, text, size)
    assert calls == []
    assert content == text


def test_a_call_after_a_malformed_one_is_content_too() -> None:
    text = hermes("weather", CITY) + "<tool_call>\nnope\n</tool_call>" + hermes("time", {})
    content, calls, _ = read(HERMES, text, 3)
    assert calls == [("weather", CITY)]
    assert content == text[len(hermes("weather", CITY)) :]


def test_gemma_notation_reads_as_json() -> None:
    assert gemma_value('{a:<|"|>x, y<|"|>,b:-1.5,c:null,d:{e:[true,"q"]},"f":2}') == {
        "a": "x, y",
        "b": -1.5,
        "c": None,
        "d": {"e": [True, "q"]},
        "f": 2,
    }
    for bad in ("{a:}", "{a:1", "{a:1}}", "{a:nope}"):
        with pytest.raises(ValueError):
            gemma_value(bad)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '<tool_call>' }}", HERMES),
        ("{{ '<|python_tag|>' }}", LLAMA3_JSON),
        ("{{ '<｜tool▁calls▁begin｜>' }}", DEEPSEEK_V3),
        ("{{ '<|tool_calls_section_begin|>' }}", KIMI_K2),
        ("{{ '<|tool_call>' }}<tool_call|>", GEMMA4),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_the_format_is_read_from_the_chat_template(template: str | None, expected: ToolFormat | None) -> None:
    assert detect_format(template) is expected


def test_the_demo_template_writes_hermes_calls() -> None:
    from tandem.settings import DEMO_CHAT_TEMPLATE

    assert detect_format(DEMO_CHAT_TEMPLATE.read_text()) is HERMES


def test_tool_call_parser_names_the_format_whatever_the_template_says() -> None:
    import argparse

    from orchestrator.settings import HttpSettings
    from tandem import flags

    parser = argparse.ArgumentParser()
    flags.add_options(parser, HttpSettings)
    chosen = flags.settings_of(HttpSettings, parser.parse_args(["--tool-call-parser", "kimi_k2"]))
    assert chosen.tool_call_parser == "kimi_k2"
    assert detect_format("{{ '<tool_call>' }}", chosen.tool_call_parser) is KIMI_K2
    assert detect_format(None, "llama3_json") is LLAMA3_JSON
    with pytest.raises(SystemExit):  # argparse refuses a format Tandem does not read
        parser.parse_args(["--tool-call-parser", "pythonic"])
