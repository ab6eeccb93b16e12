"""Tool calling against hostile tools lists (the main server): 10k tools, deep nesting and
$ref loops in parameter schemas are answered (or 400s naming the field) in seconds; never a
hang, a 500 or a stack overflow, and the server keeps serving."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.http.conftest import MODEL

pytestmark = pytest.mark.timeout(300)


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": "does a thing"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def _post(
    client: httpx.Client, tools: list[dict[str, Any]], choice: Any
) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call a tool."}],
            "tools": tools, "tool_choice": choice, "max_tokens": 8, "temperature": 0}  # fmt: skip
    t0 = time.perf_counter()
    reply = client.post("/v1/chat/completions", json=body)
    return reply, time.perf_counter() - t0


LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
          "type": "object", "properties": {"v": {"$ref": "#/$defs/a"}}}  # fmt: skip
TREE = {"$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name"]}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}}  # fmt: skip
DANGLING = {"type": "object", "properties": {"v": {"$ref": "#/$defs/missing"}}}
REMOTE = {"type": "object", "properties": {"v": {"$ref": "http://127.0.0.1:1/schema.json"}}}


NAMED_LOOP = {"type": "function", "function": {"name": "loop"}}
TEN_K = [_tool(f"f{i}") for i in range(10_000)]


@pytest.mark.parametrize(
    ("tools", "choice", "status", "words"),
    [
        (TEN_K, "required", 400, "schema too large"),
        (TEN_K, "none", 200, ""),
        (TEN_K, {"type": "function", "function": {"name": "f9999"}}, 200, ""),
        ([_tool("deep", _nested(60))], "required", 400, "recursion limit"),
        ([_tool("loop", LOOP)], "required", 400, "$ref cycle #/$defs/a -> #/$defs/a"),
        ([_tool("loop", LOOP)], NAMED_LOOP, 400, "$ref cycle"),
        ([_tool("mutual", MUTUAL)], "required", 400, "$ref cycle #/$defs/"),
        ([_tool("self", {"allOf": [{"$ref": "#"}]})],
         {"type": "function", "function": {"name": "self"}}, 400, "$ref cycle"),
        ([_tool("tree", TREE)], "required", 200, ""),
        ([_tool("dangling", DANGLING)], "required", 400, "does not exist"),
        ([_tool("remote", REMOTE)], "required", 400, "does not fetch"),
    ],
)  # fmt: skip
def test_hostile_tools(
    client: httpx.Client, tools: list[dict[str, Any]], choice: Any, status: int, words: str
) -> None:
    reply, seconds = _post(client, tools, choice)
    assert reply.status_code == status, reply.text[:1000]
    assert seconds < 30
    if status == 400:
        error = reply.json()["error"]
        assert words in error["message"] and error["param"] == "tools", error
    elif isinstance(choice, dict):  # the named function's (empty) arguments
        assert reply.json()["choices"][0]["message"]["tool_calls"], reply.text[:1000]


def test_deeply_nested_tools_body_is_a_400(client: httpx.Client) -> None:
    # 5000 levels: more than Python's JSON encoder takes, so the body is written by hand.
    depth = 5000
    nested = '{"type": "object", "properties": {"x": ' * depth + '{"type": "string"}' + "}}" * depth
    head = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tool_choice": "required"}  # fmt: skip
    tool = '{"type": "function", "function": {"name": "deep", "parameters": ' + nested + "}}"
    body = json.dumps(head)[:-1] + ', "tools": [' + tool + "]}"
    reply = client.post("/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"})  # fmt: skip
    assert reply.status_code == 400, reply.text[:500]
    assert "nested" in reply.json()["error"]["message"]
    assert client.get("/health").status_code == 200
