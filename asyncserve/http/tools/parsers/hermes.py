"""Hermes (NousResearch, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call; the text before the first block is the content."""

from __future__ import annotations

from asyncserve.http.tools.json_scan import JSONScanError, skip_ws
from asyncserve.http.tools.parsers.base import (
    ParseResult,
    ToolParser,
    call_from_object,
    held_back,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseResult:
        first = text.find(START)
        if first < 0:
            return ParseResult(text if final else held_back(text, START))
        result = ParseResult(text[:first])
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(START))
            if body >= len(text):
                break
            if text[body] != "{":
                raise JSONScanError(f"expected a JSON object after {START}")
            call, end = call_from_object(text, body)
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
            pos = text.find(START, end)
        return result
