"""Tool-call parsers on sample model outputs: whole, and streamed in small pieces (the
deltas must reassemble to the same calls and content as the whole-output parse)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from asyncserve.http.tools.forced import NamedToolParser, RequiredToolParser, required_schema
from asyncserve.http.tools.parsers import TOOL_PARSERS, ParseResult, ToolParser
from asyncserve.http.tools.stream import ToolCallStream

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]

# (parser, model output, expected content, expected [(name, arguments as a dict)])
CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (
        "hermes",
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})],
    ),
    ("hermes", "No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    (
        "hermes",  # arguments encoded as a JSON string
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        "",
        [("get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})],
    ),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]',
        "Sure. ",
        [("get_weather", {"city": "Rome", "days": 1})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", {"city": "Lima"}), ("get_time", {})],
    ),
    (
        "qwen3_xml",
        "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        "I'll look.\n",
        [("get_weather", {"city": "New York", "days": 2})],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris, France", days=2), get_time()]',
        "",
        [("get_weather", {"city": "Paris, France", "days": 2}), ("get_time", {})],
    ),
    ("pythonic", "Hello there", "Hello there", []),
]


def _streamed(parser: ToolParser, text: str, step: int) -> ParseResult:
    """Feed `text` `step` characters at a time; rebuild content and calls from the deltas."""
    stream = ToolCallStream(parser)
    content = ""
    calls: dict[int, dict[str, str]] = {}
    for start in range(0, len(text), step):
        piece = text[start : start + step]
        new, deltas = stream.feed(piece, final=start + step >= len(text))
        content += new
        for d in deltas:
            if d.id is not None:
                assert d.index not in calls and d.type == "function"
                assert d.function is not None and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            assert d.function is not None
            calls[d.index]["arguments"] += d.function.arguments or ""
    result = ParseResult(content)
    for index in sorted(calls):
        from asyncserve.http.tools.parsers import ParsedCall

        result.calls.append(ParsedCall(calls[index]["name"], calls[index]["arguments"]))
    return result


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_parser_whole_and_streamed(
    name: str, text: str, content: str, expected: list[tuple[str, dict[str, Any]]]
) -> None:
    parser = TOOL_PARSERS[name](TOOLS)
    whole = parser.extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == expected
    for step in (1, 3, 7):
        streamed = _streamed(TOOL_PARSERS[name](TOOLS), text, step)
        assert streamed.content == whole.content, step
        assert [(c.name, c.arguments) for c in streamed.calls] == [
            (c.name, c.arguments) for c in whole.calls
        ], step


def test_streaming_sends_name_before_arguments_complete() -> None:
    stream = ToolCallStream(TOOL_PARSERS["hermes"](TOOLS))
    _, deltas = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci', final=False)
    assert [d.function.name for d in deltas if d.function] == ["get_weather", None]
    assert deltas[1].function is not None and deltas[1].function.arguments == '{"ci'
    content, deltas = stream.feed('ty": "Paris"}}</tool_call>', final=True)
    assert content == ""
    assert deltas[0].function is not None and deltas[0].function.arguments == 'ty": "Paris"}'


def test_held_back_marker_prefix_is_released_when_it_is_not_a_marker() -> None:
    stream = ToolCallStream(TOOL_PARSERS["hermes"](TOOLS))
    assert stream.feed("a <tool_", final=False) == ("a ", [])
    assert stream.feed("box", final=True) == ("<tool_box", [])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # truncated
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',  # not JSON
    ],
)
def test_malformed_calls_come_back_as_content(text: str) -> None:
    result = TOOL_PARSERS["hermes"](TOOLS).extract(text)
    assert result.content == text and result.calls == []


def test_required_parser_and_schema() -> None:
    schema = required_schema(TOOLS, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    text = '[{"name": "get_weather", "parameters": {"city": "Bern"}}]'
    whole = RequiredToolParser(TOOLS).extract(text)
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", '{"city": "Bern"}')]
    streamed = _streamed(RequiredToolParser(TOOLS), text, 2)
    assert [(c.name, c.arguments) for c in streamed.calls] == [("get_weather", '{"city": "Bern"}')]


def test_named_parser_streams_the_whole_output_as_arguments() -> None:
    streamed = _streamed(NamedToolParser(TOOLS, "get_time"), '{"tz": "UTC"}', 4)
    assert [(c.name, c.arguments) for c in streamed.calls] == [("get_time", '{"tz": "UTC"}')]
