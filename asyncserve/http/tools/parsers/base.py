"""What every tool-call parser shares: the parse result, and helpers for calls written as
JSON objects ({"name": ..., "arguments": {...}}).

A parser reads the whole output so far (`final`: the model is done) and returns the text
outside tool calls and the calls seen so far. While not final, a call's arguments are a
prefix of what they will be, and the content never includes text that may turn out to be
the start of a tool call, so a stream can send the difference between two parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from asyncserve.http.tools.json_scan import JSONScanError, Span, scan_object


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; while streaming, a prefix of the final arguments
    complete: bool = True


@dataclass
class ParseResult:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Base class: subclasses implement `parse`; `tools` are the request's (OpenAI shape)."""

    # Parsers whose markers are special tokens need them left in the text.
    keeps_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = tools

    def parse(self, text: str, final: bool) -> ParseResult:
        raise NotImplementedError

    def extract(self, text: str) -> ParseResult:
        """The finished output's calls; when any call is malformed, the whole text is
        content and there are no calls (vLLM's behaviour)."""
        try:
            result = self.parse(text, final=True)
        except (JSONScanError, ValueError, SyntaxError):
            return ParseResult(text)
        if not all(c.complete and _is_json(c.arguments) for c in result.calls):
            return ParseResult(text)
        return result


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (sent once it is not)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


def call_from_object(
    text: str, start: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[ParsedCall | None, int | None]:
    """The call in the object at text[start] and where the object ends (None: not yet).

    None for the call until its name is complete. Arguments given as a JSON string (some
    models encode them) are decoded once complete."""
    obj = scan_object(text, start)
    name_span = obj.fields.get("name")
    if name_span is None or not name_span.complete:
        if obj.end is not None:
            raise JSONScanError("a tool call without a name")
        return None, None
    name = json.loads(text[name_span.start : name_span.end])
    if not isinstance(name, str):
        raise JSONScanError("a tool call's name must be a string")
    args_span = next((obj.fields[k] for k in args_keys if k in obj.fields), None)
    arguments = _arguments(text, args_span, obj.end is not None)
    return ParsedCall(name, arguments, obj.end is not None), obj.end


def _arguments(text: str, span: Span | None, object_done: bool) -> str:
    if span is None:
        return "{}" if object_done else ""
    raw = text[span.start : span.end]
    if raw.startswith('"'):
        return json.loads(raw) if span.complete else ""
    return raw
