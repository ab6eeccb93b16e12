"""Llama 3.1/3.2 JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (after an
optional <|python_tag|>), several joined with ';'. Output that does not start that way is
plain content."""

from __future__ import annotations

from asyncserve.http.tools.json_scan import JSONScanError, skip_ws
from asyncserve.http.tools.parsers.base import ParseResult, ToolParser, call_from_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ParseResult("")  # nothing yet, or the tag is still arriving
        if i >= len(text):
            return ParseResult("" if not final else text)
        if text[i] != "{":
            return ParseResult(text)
        result = ParseResult("")
        while i < len(text):
            call, end = call_from_object(text, i)
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text):
                if text[i] != ";":
                    raise JSONScanError(f"expected ';' between tool calls at offset {i}")
                i = skip_ws(text, i + 1)
        return result
