"""tool_choice "required" and a named function: the output is forced by a JSON schema built
from the tools (as vLLM builds it), and read back as tool calls by these parsers."""

from __future__ import annotations

import copy
from typing import Any

from asyncserve.http.tools.json_scan import JSONScanError, array_elements, skip_ws
from asyncserve.http.tools.parsers.base import (
    ParsedCall,
    ParseResult,
    ToolParser,
    call_from_object,
)

_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or _EMPTY_OBJECT


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """An array of {"name", "parameters"} objects, each one of the tools with its own
    parameter schema; the tools' $defs are lifted to the top, where their $refs point."""
    options = []
    defs: dict[str, Any] = {}
    for tool in tools:
        function = tool["function"]
        params = copy.deepcopy(parameters_schema(function))
        defs.update(params.pop("$defs", {}) if isinstance(params, dict) else {})
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                # Unlike vLLM's, no other keys: a small model would otherwise add keys
                # until max_tokens and the call would never close.
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": options},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class RequiredToolParser(ToolParser):
    """The output is the JSON array `required_schema` describes."""

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParseResult("")
        if text[i] != "[":
            raise JSONScanError("expected a JSON array of tool calls")
        result = ParseResult("")
        starts, _ = array_elements(text, i)
        for start in starts:
            call, end = call_from_object(text, start, args_keys=("parameters",))
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
        return result


class NamedToolParser(ToolParser):
    """The output is the named function's arguments, nothing else."""

    def __init__(self, tools: list[dict[str, Any]], name: str) -> None:
        super().__init__(tools)
        self.name = name

    def parse(self, text: str, final: bool) -> ParseResult:
        return ParseResult("", [ParsedCall(self.name, text, final)])

    def extract(self, text: str) -> ParseResult:
        # The whole output is the call, cut short or not (as vLLM and OpenAI return a
        # truncated forced call): a stream has sent it as the call's arguments already.
        return self.parse(text, final=True)
