"""Pythonic tool calls (Llama 3.2 / Llama 4, vLLM's `pythonic`): the output is a Python list
of calls with keyword arguments of literal values, `[get_weather(city="Paris"), f(x=1)]`.
A call is streamed once its closing parenthesis has arrived; output that is not such a list
is plain content."""

from __future__ import annotations

import ast
import json

from asyncserve.http.tools.parsers.base import ParsedCall, ParseResult, ToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START) :].strip()
        if body.endswith(PYTHON_END):
            body = body[: -len(PYTHON_END)].strip()
        if not final and (not body or PYTHON_START.startswith(body)):
            return ParseResult("")
        if not body.startswith("["):
            return ParseResult(text)
        if final:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                raise SyntaxError("pythonic tool calls must be a list")
            return ParseResult("", [_call(node) for node in tree.elts])
        return ParseResult("", [_call(ast.parse(s, mode="eval").body) for s in _complete(body)])


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise SyntaxError("each pythonic tool call must be name(keyword=value, ...)")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False))


def _complete(body: str) -> list[str]:
    """The source of each call of the list whose closing parenthesis has arrived."""
    calls: list[str] = []
    depth = 0
    quote: str | None = None
    start = 1
    i = 1
    while i < len(body):
        c = body[i]
        if quote is not None:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and c == ")":
                calls.append(body[start : i + 1].strip())
            if depth < 0:
                break
        elif c == "," and depth == 0:
            start = i + 1
        i += 1
    return calls
