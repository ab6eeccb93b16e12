"""Tool calling through the OpenAI SDK against the real server (SmolLM2, no tool-call parser
configured): tool_choice "required" and a named function are forced through the grammar, so
the calls parse with the SDK and their arguments validate against the tool's schema; a
stream's deltas reassemble to the same calls; "auto" without a parser is a 400 naming the
flags; tools and tool_call_id reach the chat template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest
from llguidance import LLMatcher

from asyncserve.core.grammar import build_ll_tokenizer, compile_grammar
from asyncserve.http.chat_prompt import render_chat_prompt
from asyncserve.http.protocol import ChatCompletionRequest
from asyncserve.http.tools.forced import required_schema
from asyncserve.http.tools.plan import plan_tools
from asyncserve.http.tools.protocol import ChatTool
from asyncserve.sampling_params import StructuredOutputsParams
from tests.http.conftest import MODEL

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls: Any) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_calls_parse_validate_and_stream_the_same(oai: Any, tool_choice: Any) -> None:
    kwargs = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=60,
        parallel_tool_calls=False,
    )
    done = oai.chat.completions.create(**kwargs)
    choice = done.choices[0]
    calls = _check_calls(choice.message.tool_calls)
    assert choice.message.content is None
    if tool_choice == "required":
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"
    else:
        assert calls[0][0] == "get_weather" and choice.finish_reason == "stop"

    with oai.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion()
    assert _check_calls(streamed.choices[0].message.tool_calls) == calls
    assert streamed.choices[0].finish_reason == choice.finish_reason


def test_stream_deltas_in_openai_shape(client: Any) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
        "max_tokens": 30,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in lines if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, rest = calls[0], calls[1:]
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"] == {"name": "get_time", "arguments": ""}
    assert rest and all(set(c) == {"index", "function"} for c in rest)
    arguments = "".join(c["function"]["arguments"] for c in rest)
    assert json.loads(arguments)["zone"] in ("UTC", "CET", "PST")


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_call_cut_by_max_tokens(client: Any, tool_choice: Any) -> None:
    """A forced call cut short keeps finish_reason "length" streamed or not, and a stream
    never repeats the call's text as content after its argument deltas."""
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 0, "max_tokens": 12 if tool_choice == "required" else 5}  # fmt: skip
    done = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert done["finish_reason"] == "length"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    deltas = [c["delta"] for c in choices]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.get("tool_calls") or []]
    assert calls, deltas
    if tool_choice != "required":  # named: the cut arguments are the call, as vLLM's
        arguments = "".join(t["function"]["arguments"] for t in calls)
        assert [c["function"]["arguments"] for c in done["message"]["tool_calls"]] == [arguments]


def test_bad_tool_requests_are_400s_naming_the_field(client: Any) -> None:
    def post(**fields: Any) -> Any:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}
        return client.post("/v1/chat/completions", json=body)

    cases = [
        ({"tools": TOOLS}, "tools", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "nope",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name", ""),
        ({"tools": [{"type": "web", "function": {"name": "x"}}]}, "tools[0].type", ""),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "schema",
        ),
        (
            {
                "messages": [{"role": "assistant", "tool_calls": ["not an object"]}],
            },
            "messages[0].tool_calls[0]",
            "",
        ),
    ]
    for fields, param, words in cases:
        r = post(**fields)
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (fields, error)
        assert words in error["message"], (fields, error)
    # tool_choice "none" needs no parser: the tools go to the template, the reply is text.
    r = post(tools=TOOLS, tool_choice="none")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


TEMPLATE = (
    "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call {{ c.function.name }} "
    "city={{ c.function.arguments.city }}{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ m.content }}{% endfor %}"
)


def test_tools_and_tool_turns_reach_the_template(tokenizer: Any) -> None:
    body = msgspec.convert(
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            ],
            "tools": TOOLS,
            "add_generation_prompt": False,
        },
        ChatCompletionRequest,
    )
    text = render_chat_prompt(tokenizer, body, TEMPLATE)
    assert text == (
        "[tool get_weather][tool get_time]<user>What is the weather in Paris?"
        "<assistant>call get_weather city=Paris<tool>(call_1)18 C"
    )


def test_plan_for_each_tool_choice() -> None:
    tools = [msgspec.convert(t, ChatTool) for t in TOOLS]
    assert plan_tools(None, None, None, None, False).mode == "none"
    assert plan_tools(tools, "none", None, None, False).mode == "none"
    auto = plan_tools(tools, None, None, "hermes", False)
    assert auto.mode == "auto" and type(auto.new_parser()).__name__ == "HermesToolParser"
    required = plan_tools(tools, "required", False, None, False)
    assert required.mode == "required" and not required.parallel


# Each node's `child` is another node: a $ref to the schema's own root.
SELF_REF = {"type": "object", "properties": {"child": {"$ref": "#"}}}
LABELLED = {
    "type": "object",
    "properties": {"label": {"type": "string", "maxLength": 8}, "child": {"$ref": "#"}},
    "additionalProperties": False,
}
PEERS = {  # a $ref into the tool's own properties
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
    "required": ["a"],
    "additionalProperties": False,
}


def _function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_required_schema_keeps_each_tools_refs(tokenizer: Any) -> None:
    """Inside the array of calls a tool's "#" still means its own parameters, and two
    tools' $defs of the same name stay apart: for JSON Schema and for the grammar."""
    node = {"type": "object", "properties": {"v": {"$ref": "#/$defs/v"}}, "required": ["v"]}
    tools = [
        _function("tree", LABELLED),
        _function("peers", PEERS),
        _function("ints", {**node, "$defs": {"v": {"type": "integer"}}}),
        _function("strs", {**node, "$defs": {"v": {"type": "string"}}}),
    ]
    schema = required_schema(tools, parallel=True)
    calls = [
        {"name": "tree", "parameters": {"child": {"label": "a", "child": {}}}},
        {"name": "peers", "parameters": {"a": 1, "b": 2}},
        {"name": "ints", "parameters": {"v": 3}},
        {"name": "strs", "parameters": {"v": "x"}},
    ]
    jsonschema.validate(calls, schema)
    for bad in ({"name": "tree", "parameters": {"child": []}},
                {"name": "ints", "parameters": {"v": "x"}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    grammar = compile_grammar(StructuredOutputsParams(json=schema)).grammar
    ll_tokenizer = build_ll_tokenizer(tokenizer.backend, tokenizer.vocab_size, [2])
    for call in calls:
        matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
        text = json.dumps([call], separators=(",", ":"))
        assert matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)), text
        assert matcher.is_accepting(), text
    assert LABELLED["properties"]["child"] == {"$ref": "#"}


@pytest.mark.parametrize(
    ("parameters", "tool_choice"),
    [
        (SELF_REF, "required"),
        (SELF_REF, {"type": "function", "function": {"name": "f"}}),
        (PEERS, "required"),
    ],
    ids=["self-required", "self-named", "peers-required"],
)
def test_recursive_tool_schema_is_a_call(client: Any, parameters: Any, tool_choice: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}],
            "tools": [_function("f", parameters)], "tool_choice": tool_choice,
            "temperature": 0, "max_tokens": 80}  # fmt: skip
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text[:1000]
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "stop"), choice
    calls = choice["message"]["tool_calls"]
    assert calls and choice["message"]["content"] is None, choice
    for call in calls:
        assert call["function"]["name"] == "f"
        jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "f"}}],
    ids=["required", "named"],
)  # fmt: skip
def test_unmatchable_recursive_tool_is_a_400_before_generation(
    client: Any, tool_choice: Any
) -> None:
    """A tool whose every value must hold another (a required self-reference) has no
    finite arguments: a 400 naming the tool's parameters, and the server goes on."""
    endless = {**LABELLED, "required": ["child"]}
    body = {"model": MODEL, "messages": MESSAGES, "tools": [_function("f", endless)],
            "tool_choice": tool_choice, "max_tokens": 8}  # fmt: skip
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text[:1000]
    error = reply.json()["error"]
    assert error["param"] == "tools", error
    assert "tools[0].function.parameters: invalid schema" in error["message"], error
    assert "#/properties/child -> #" in error["message"], error
    again = {**body, "tools": [_function("f", SELF_REF)]}
    assert client.post("/v1/chat/completions", json=again).status_code == 200
