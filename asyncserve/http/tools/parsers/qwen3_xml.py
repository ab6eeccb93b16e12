"""Qwen3-Coder's XML tool calls (vLLM's qwen3_xml / qwen3_coder):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each becomes the JSON type its schema gives (strings stay
strings, anything else is read as JSON when it parses). Arguments stream one complete
parameter at a time, so every fragment is a prefix of the final JSON object.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asyncserve.http.tools.parsers.base import ParsedCall, ParseResult, ToolParser, held_back

START = "<tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_END = "</function>"


class Qwen3XmlToolParser(ToolParser):
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParseResult:
        first = text.find(START)
        if first < 0:
            return ParseResult(text if final else held_back(text, START))
        result = ParseResult(text[:first])
        pos = first + len(START)
        while True:
            header = _FUNCTION.search(text, pos)
            if header is None:
                break
            name = header.group(1).strip()
            body_end = text.find(_FUNCTION_END, header.end())
            body = text[header.end() : body_end if body_end >= 0 else len(text)]
            params = [
                (m.group(1).strip(), self._value(name, m.group(1).strip(), m.group(2)))
                for m in _PARAMETER.finditer(body)
            ]
            pairs = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in params)
            if body_end < 0:
                result.calls.append(ParsedCall(name, "{" + pairs, False))
                break
            result.calls.append(ParsedCall(name, "{" + pairs + "}"))
            pos = body_end + len(_FUNCTION_END)
        return result

    def _value(self, function: str, param: str, raw: str) -> Any:
        # One newline on each side belongs to the markup, not to the value.
        text = raw[1:] if raw.startswith("\n") else raw
        text = text[:-1] if text.endswith("\n") else text
        if _param_type(self.tools, function, param) in ("string", None):
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


def _param_type(tools: list[dict[str, Any]], function: str, param: str) -> str | None:
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == function:
            schema = ((fn.get("parameters") or {}).get("properties") or {}).get(param) or {}
            kind = schema.get("type") if isinstance(schema, dict) else None
            return kind if isinstance(kind, str) else "any"
    return None
