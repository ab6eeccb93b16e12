"""Structured outputs and beam search over HTTP, on the shared SmolLM2 server."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from asyncserve import BeamSearchParams
from asyncserve.llm import LLM
from tests.http.conftest import MODEL

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_completions_structured_outputs(client: httpx.Client) -> None:
    out = complete(
        client,
        prompt="A person as JSON:",
        max_tokens=80,
        temperature=0.8,
        seed=5,
        n=3,
        structured_outputs={"json": PERSON},
    )
    assert len(out["choices"]) == 3
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), PERSON)
    out = complete(
        client,
        prompt="The capital of France is",
        max_tokens=10,
        temperature=0.0,
        structured_outputs={"choice": ["Paris", "Rome"]},
    )
    assert out["choices"][0]["text"] in ("Paris", "Rome")
    out = complete(
        client,
        prompt="A date:",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        structured_outputs={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out["choices"][0]["text"])


def test_chat_response_format(client: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 80,
        "temperature": 0.0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)

    prompt = [{"role": "user", "content": 'Return the JSON object {"ok": true}.'}]
    body = {"model": MODEL, "messages": prompt, "max_tokens": 40, "temperature": 0.0}
    body["response_format"] = {"type": "json_object"}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert isinstance(json.loads(response.json()["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize(
    ("path", "extra", "param", "message"),
    [
        (
            "/v1/completions",
            {"structured_outputs": {"json": {"type": "objectx"}}},
            "structured_outputs",
            "structured_outputs.json: invalid schema",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a(b"}},
            "structured_outputs",
            "structured_outputs.regex: invalid regex",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": "start: nowhere"}},
            "structured_outputs",
            "structured_outputs.grammar: invalid grammar",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "integer", "minimum": 3, "maximum": 1},
                    },
                }
            },
            "response_format",
            "structured_outputs.json: invalid schema",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "xml"),
        # The field the constraint came from, on either route.
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
            "invalid schema",
        ),
        ("/v1/completions", {"guided_json": "{bad"}, "guided_json", "invalid schema"),
        ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
        ("/v1/completions", {"guided_grammar": "start: x"}, "guided_grammar", "invalid grammar"),
        ("/v1/completions", {"use_beam_search": True, "stream": True}, "stream", "stream"),
        ("/v1/completions", {"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", "best_of"),
        ("/v1/completions", {"use_beam_search": True, "best_of": 11}, "best_of", "beam_width"),
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search", "completions"),
        # Fields beam search would silently ignore are refused.
        (
            "/v1/completions",
            {"use_beam_search": True, "guided_choice": ["a"]},
            "guided_choice",
            "structured outputs",
        ),
        ("/v1/completions", {"use_beam_search": True, "stop": [" "]}, "stop", "stop"),
        (
            "/v1/completions",
            {"use_beam_search": True, "prompt_logprobs": 1},
            "prompt_logprobs",
            "prompt_logprobs",
        ),
        (
            "/v1/completions",
            {"use_beam_search": True, "logit_bias": {"1": 5}},
            "logit_bias",
            "logit_bias",
        ),
        ("/v1/completions", {"use_beam_search": True, "min_tokens": 2}, "min_tokens", "min_tokens"),
    ],
)
def test_bad_constraints_and_beam_requests_are_400(
    client: httpx.Client, path: str, extra: dict[str, Any], param: str, message: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "Hello"})
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


# Every value must hold another one: llguidance compiles it, then fails mid-output.
SELF_REQUIRING = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def test_self_requiring_schema_is_400_before_the_engine(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REQUIRING}}
    for path, extra, param in (
        ("/v1/chat/completions", {"messages": CHAT, "response_format": fmt}, "response_format"),
        ("/v1/completions", {"prompt": "Hello", "structured_outputs": {"json": SELF_REQUIRING}},
         "structured_outputs"),
    ):  # fmt: skip
        response = client.post(path, json={"model": MODEL, "max_tokens": 8, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        # Refused by the checks before queueing, not by the engine (code "request_failed").
        assert error["param"] == param and error["code"] == 400, error
        assert "# -> #/properties/a -> #" in error["message"], error
    # The server still answers.
    complete(client, prompt="Hello", max_tokens=2)


def test_beam_search_matches_offline(client: httpx.Client, smollm2_llm: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):"]
    out = complete(
        client, prompt=prompts, max_tokens=6, n=2, best_of=3, use_beam_search=True, ignore_eos=True
    )
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    offline = smollm2_llm.beam_search(prompts, params)
    tokenizer = smollm2_llm.get_tokenizer()
    expected = [
        tokenizer.decode(seq.output_token_ids) for res in offline for seq in res.sequences[:2]
    ]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == expected
    assert out["usage"]["completion_tokens"] == 4 * 6

    response = client.post(
        "/generate",
        json={
            "prompt": prompts[0],
            "max_tokens": 6,
            "n": 2,
            "best_of": 3,
            "use_beam_search": True,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["text"] == [prompts[0] + text for text in expected[:2]]


NO_ALLOWED_TOKEN = "allowed_token_ids: no allowed token can continue the constrained output"


def test_allowed_token_ids_the_constraint_cannot_start_with_are_400(
    client: httpx.Client, tokenizer: Any
) -> None:
    words = tokenizer.encode(" hello", add_special_tokens=False)  # no digit, "{" or choice
    fmt = {"type": "json_object"}
    for path, extra, field in (
        ("/v1/completions", {"prompt": "Hello", "guided_choice": ["Paris", "Rome"]},
         "guided_choice"),
        ("/v1/completions", {"prompt": "Hello", "guided_regex": "[0-9]+"}, "guided_regex"),
        ("/v1/chat/completions", {"messages": CHAT, "response_format": fmt}, "response_format"),
    ):  # fmt: skip
        body = {"model": MODEL, "max_tokens": 8, "allowed_token_ids": words, **extra}
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "allowed_token_ids" and error["code"] == 400, error
        assert error["message"].startswith(NO_ALLOWED_TOKEN), error
        assert f"{field} allows none of the" in error["message"], error
    # The server still answers.
    complete(client, prompt="Hello", max_tokens=2)


def test_allowed_token_ids_that_run_out_mid_output_end_that_request(
    client: httpx.Client, tokenizer: Any
) -> None:
    # "Par" may start "Paris", but nothing allowed can complete it.
    par = tokenizer.encode("Par", add_special_tokens=False)
    body = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0.0,
        "allowed_token_ids": par,
        "guided_choice": ["Paris", "Rome"],
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "allowed_token_ids", error
    assert error["message"].startswith(NO_ALLOWED_TOKEN), error
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["param"] == "allowed_token_ids", events
    # Other requests are unaffected.
    out = complete(client, prompt="The capital of France is", max_tokens=4, temperature=0.0)
    assert out["choices"][0]["finish_reason"] == "length"


NO_UNBANNED_TOKEN = "bad_words: every token the constrained output allows next is a bad word"


def test_bad_words_that_leave_the_constraint_nothing_are_400_naming_them(
    client: httpx.Client,
) -> None:
    # The constraint's only next token is a bad word: every logit is masked, so whatever
    # is drawn breaks the grammar. The error names bad_words, not the grammar engine's parse.
    tool = {"type": "function", "function": {"name": "f"}}
    for path, extra in (
        ("/v1/completions", {"prompt": "Hi", "guided_choice": ["a"], "bad_words": ["a"]}),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [tool], "tool_choice": "required",
                                  "bad_words": ["["]}),
    ):  # fmt: skip
        body = {"model": MODEL, "max_tokens": 4, **extra}
        response = client.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "bad_words", error
        assert error["message"].startswith(NO_UNBANNED_TOKEN), error
        assert "Parser Error" not in error["message"], error
        with client.stream("POST", path, json={**body, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert len(errors) == 1 and errors[0]["param"] == "bad_words", events
    # A bad word the constraint can do without is simply avoided.
    out = complete(client, prompt="Hi", max_tokens=4, guided_choice=["a", "b"], bad_words=["a"])
    assert out["choices"][0]["text"] == "b"
