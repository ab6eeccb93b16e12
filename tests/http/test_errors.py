"""Bad input gets a 4xx in OpenAI's error shape naming the field, never a 500 or a traceback,
and never hurts the requests around it."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.http.conftest import MODEL, wait_idle

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "hi"}]


ANY = object()


def assert_error(response: httpx.Response, status: int, param: object) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert param is ANY or error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    return error


# (path, body, expected param) -> 400
BAD_BODIES: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 100000}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, "n"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4000}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    # No max_tokens: min_tokens must fit in what max_model_len leaves after the prompt.
    ("/v1/completions", {"prompt": [100] * 2040, "max_tokens": None, "min_tokens": 20}, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2100}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, "stop[0]"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": "high"}}, "logit_bias[...]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"²": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 2049}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "priority": 5}, "priority"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "x", "model": 3}, "model"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": [1]}, "stream_options"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": 12}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "hello " * 3000, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1_0": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5000}, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
         "continue_final_message": True},
        "messages[1].content",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    # A constraint field asyncserve does not implement is refused, not silently dropped.
    (
        "/v1/chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_object", "schema": {"type": "integer"}}},
        "response_format.schema",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
    ),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
    # Names the renderer's own parameters take: not a template error in messages.
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"template": "x"}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 3000}]}, "messages"),
    # Not silently dropped from the batch route's response.
    ("/v1/chat/completions/batch", {"messages": [CHAT], "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/generate", {"prompt": "x", "n": "two"}, "n"),
    ("/generate", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/generate", {"prompt": "x", "max_tokens": 99999}, "max_tokens"),
    ("/generate", {"max_tokens": 3}, "prompt"),
    ("/generate", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/generate", {"prompt": "x", "use_beam_search": True, "stop": "x"}, "stop"),
    # A schema pattern is held to the regex size limit (it used to stall the first masks).
    (
        "/v1/chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}},
        "response_format",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    BAD_BODIES,
    ids=[f"{p}:{','.join(b) or 'empty'}:{param}" for p, b, param in BAD_BODIES],
)
def test_bad_field_is_a_400_naming_it(
    client: httpx.Client, path: str, body: dict[str, Any], param: str | None
) -> None:
    error = assert_error(client.post(path, json=body), 400, param)
    assert error["type"] == "BadRequestError"


@pytest.mark.parametrize("stop", ["", [""]])
def test_empty_stop_message_fits_what_was_sent(client: httpx.Client, stop: Any) -> None:
    body = {"prompt": "x", "stop": stop}
    error = assert_error(client.post("/v1/completions", json=body), 400, "stop")
    assert "non-empty string or a list of non-empty strings" in error["message"], error


@pytest.mark.parametrize("value", [b"1e999", b"-1e999", b"1e308"])
def test_non_finite_numbers_are_a_400(client: httpx.Client, value: bytes) -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": '
    raw += value + b"}"
    response = client.post("/v1/chat/completions", content=raw)
    if value == b"1e308":  # finite, merely huge: a valid temperature
        assert response.status_code == 200, response.text
    else:
        assert_error(response, 400, "temperature")


@pytest.mark.parametrize(
    "extra",
    [
        {"max_completion_tokens": 0},
        {"max_completion_tokens": -1},
        {"max_completion_tokens": 5000},
        {"max_completion_tokens": 2, "min_tokens": 5},
        {"max_tokens": 3, "max_completion_tokens": 0},
    ],
)
def test_max_completion_tokens_errors_name_it(client: httpx.Client, extra: dict[str, Any]) -> None:
    # The message names the field the client sent, not SamplingParams' max_tokens.
    response = client.post("/v1/chat/completions", json={"messages": CHAT, **extra})
    param = "min_tokens" if "min_tokens" in extra else "max_completion_tokens"
    error = assert_error(response, 400, param)
    assert "max_completion_tokens" in error["message"], error
    assert re.search(r"(?<![\w.])max_tokens", error["message"]) is None, error


def test_echo_only_min_tokens_names_the_max_tokens_sent(client: httpx.Client) -> None:
    body = {"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 2}
    error = assert_error(client.post("/v1/completions", json=body), 400, "min_tokens")
    assert "max_tokens (0)" in error["message"], error


def test_prompt_over_max_model_len_gives_both_lengths(client: httpx.Client) -> None:
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "hello " * 3000, "max_tokens": 1}),
        400,
        "prompt",
    )
    numbers = [int(w) for w in re.findall(r"\d+", error["message"])]
    assert 2048 in numbers and any(n >= 3000 for n in numbers), error
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4000}),
        400,
        "max_tokens",
    )
    assert "2048" in error["message"] and "4000" in error["message"], error


@pytest.mark.parametrize(
    "raw",
    [
        b"{bad json",
        b"",
        b"[1, 2]",
        b"null",
        b'{"prompt": "x",}',
        b'{"prompt": "\xed\xb3\xbf"}',  # not UTF-8
        b'{"prompt": "\\udcff"}',  # a lone surrogate escape
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_malformed_json_is_a_400(client: httpx.Client, path: str, raw: bytes) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    # Unparseable: no field to name. Parseable but without the required field: that field.
    assert_error(response, 400, ANY)


@pytest.mark.parametrize(
    ("raw", "escape"),
    [
        (b'{"prompt": "a\\ud800b", "max_tokens": 1}', "\\ud800"),
        (b'{"prompt": "\\ud83d\\ude00 \\uDC00", "max_tokens": 1}', "\\uDC00"),
    ],
)
def test_lone_surrogate_escape_is_named(client: httpx.Client, raw: bytes, escape: str) -> None:
    # Not msgspec's "Input data was truncated": the escape, where it is, and why.
    response = client.post("/v1/completions", content=raw)
    error = assert_error(response, 400, None)
    assert f"the escape {escape} at byte {raw.index(escape.encode())}" in error["message"]
    assert "lone UTF-16 surrogate" in error["message"], error
    ok = client.post("/v1/completions", content=b'{"prompt": "a\\ud83d\\ude00b", "max_tokens": 1}')
    assert ok.status_code == 200, ok.text  # a surrogate pair is valid


def test_body_over_the_limit_is_a_413(client: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    assert_error(client.post("/v1/completions", content=big), 413, None)

    def chunks() -> Any:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    assert_error(client.post("/v1/completions", content=chunks()), 413, None)


def test_unknown_route_and_method_are_json(client: httpx.Client) -> None:
    error = assert_error(client.get("/v1/nope"), 404, None)
    assert "/v1/nope" in error["message"]
    assert_error(client.get("/v1/completions"), 405, None)
    assert_error(client.post("/v1/models"), 405, None)


def test_bad_requests_do_not_hurt_a_running_stream(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    reference = client.post("/v1/completions", json={**body, "stream": False}).json()
    with client.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        for path, bad, _ in BAD_BODIES[::4]:
            assert client.post(path, json=bad).status_code == 400
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"

    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in [first, *rest[:-1]])
    assert text == reference["choices"][0]["text"]
    health = wait_idle(client)
    assert health["status"] == "ok"
    assert health["num_free_blocks"] == health["num_total_blocks"]


EXTREME_BUT_VALID: list[dict[str, Any]] = [
    {"seed": -(2**63)}, {"seed": 2**63 - 1, "n": 2}, {"top_k": 2**31 - 1},
    {"temperature": 1e-9}, {"temperature": 1e300}, {"top_p": 1e-9}, {"min_p": 1.0},
    {"stop_token_ids": [10**9]}, {"min_tokens": 3, "stop_token_ids": [10**9, 5]},
    {"repetition_penalty": 1e300}, {"repetition_penalty": 1e-300},
    {"presence_penalty": 2, "frequency_penalty": -2}, {"logprobs": 20, "echo": True},
    {"prompt_logprobs": 20}, {"prompt": [0]}, {"max_tokens": 20, "stop": ["."] * 64},
    # Beam scores len ** length_penalty: overflows and underflows to 0 (not a 500).
    {"use_beam_search": True, "n": 2, "length_penalty": 1e300},
    {"use_beam_search": True, "n": 2, "length_penalty": -1e300},
]  # fmt: skip


@pytest.mark.parametrize("extra", EXTREME_BUT_VALID, ids=[",".join(e) for e in EXTREME_BUT_VALID])
def test_extreme_but_valid_values_are_served(client: httpx.Client, extra: dict[str, Any]) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert client.get("/health").json()["status"] == "ok"
