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
    parameter schema. A tool's schema sits inside the array's, so its local $refs ("#",
    "#/$defs/a", "#/properties/b") are rewritten to where it now is: "#" still means the
    tool's own parameters, and two tools' $defs of the same name stay apart."""
    options = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        where = f"#/items/anyOf/{i}/properties/parameters"
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": relocate_refs(parameters_schema(function), where),
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
    return schema


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference;
# and those whose values map names to schemas (a property called "enum" is a schema).
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_NAMED_SCHEMAS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def relocate_refs(schema: Any, where: str) -> Any:
    """A copy of `schema` for the place `where` (a JSON pointer such as "#/a/b") inside a
    larger document: its local $refs ("#" and "#/...") get `where` in front. Below an
    "$id" nothing is rewritten: there "#" is that resource's own root, wherever it sits."""
    if isinstance(schema, list):
        return [relocate_refs(item, where) for item in schema]
    if not isinstance(schema, dict) or isinstance(schema.get("$id"), str):
        return copy.deepcopy(schema)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = where + value[1:]
        elif key in _DATA_KEYWORDS or key == "$ref":
            out[key] = copy.deepcopy(value)
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: relocate_refs(sub, where) for name, sub in value.items()}
        else:
            out[key] = relocate_refs(value, where)
    return out


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
