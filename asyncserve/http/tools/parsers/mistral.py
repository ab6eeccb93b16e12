"""Mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} objects, or (newer
tokenizers) `[TOOL_CALLS]name[ARGS]{...}` per call. The text before it is the content."""

from __future__ import annotations

from asyncserve.http.tools.json_scan import JSONScanError, array_elements, scan_value, skip_ws
from asyncserve.http.tools.parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    call_from_object,
    held_back,
)

START = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class MistralToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseResult:
        first = text.find(START)
        if first < 0:
            return ParseResult(text if final else held_back(text, START))
        result = ParseResult(text[:first])
        i = skip_ws(text, first + len(START))
        if i >= len(text):
            return result
        if text[i] == "[":
            self._json_array(text, i, result)
        else:
            self._name_args(text, i, result)
        return result

    def _json_array(self, text: str, i: int, result: ParseResult) -> None:
        starts, _ = array_elements(text, i)
        for start in starts:
            call, end = call_from_object(text, start)
            if call is not None:
                result.calls.append(call)
            if end is None:
                return

    def _name_args(self, text: str, i: int, result: ParseResult) -> None:
        while i < len(text):
            marker = text.find(ARGS, i)
            if marker < 0:
                return  # the name is still arriving
            name = text[i:marker].strip()
            start = skip_ws(text, marker + len(ARGS))
            if not name:
                raise JSONScanError("a tool call without a name")
            if start >= len(text):
                result.calls.append(ParsedCall(name, "", False))
                return
            end = scan_value(text, start)
            if end is None:
                result.calls.append(ParsedCall(name, text[start:], False))
                return
            result.calls.append(ParsedCall(name, text[start:end]))
            i = skip_ws(text, end)
            if text.startswith(START, i):
                i = skip_ws(text, i + len(START))
            elif i < len(text):
                raise JSONScanError(f"unexpected text after a tool call at offset {i}")
