"""vLLM's request fields that change the output are applied, not silently dropped; a field
asyncserve does not implement is a 400 naming it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.http.conftest import MODEL

PROMPT = "The capital of France is"


def complete(client: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    return client.post("/v1/completions", json=body)


def chat(client: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **fields}
    return client.post("/v1/chat/completions", json=body)


def token_ids(choice: dict[str, Any]) -> list[int]:
    """The sampled ids, from logprobs with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_unknown_field_is_a_400_naming_it(client: httpx.Client, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "frobnicate": 1}
    if route == "/v1/chat/completions":
        body.update(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    else:
        body["prompt"] = "Hi"
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "frobnicate"


def test_allowed_token_ids_and_token_ids_in_logprobs(client: httpx.Client) -> None:
    allowed = [28, 29, 30, 31]
    r = complete(client, allowed_token_ids=allowed, logprobs=0, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    ids = token_ids(r.json()["choices"][0])
    assert len(ids) == 6 and set(ids) <= set(allowed)
    out_of_vocab = complete(client, allowed_token_ids=[10**9])
    assert out_of_vocab.status_code == 400
    assert out_of_vocab.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words(client: httpx.Client) -> None:
    plain = complete(client).json()["choices"][0]["text"]
    assert "Paris" in plain
    banned = complete(client, bad_words=["Paris"]).json()["choices"][0]["text"]
    assert "Paris" not in banned


def test_truncate_prompt_tokens(client: httpx.Client) -> None:
    long_prompt = "one two three four five six seven eight nine ten " * 4
    r = complete(client, prompt=long_prompt, truncate_prompt_tokens=5, echo=True, max_tokens=1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5
    assert r.json()["choices"][0]["text"].startswith(" seven eight nine ten ")
    bad = complete(client, truncate_prompt_tokens=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_guided_choice(client: httpx.Client) -> None:
    r = complete(client, guided_choice=["yes", "no"], max_tokens=8)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    both = complete(client, guided_choice=["a"], guided_regex="b")
    assert both.status_code == 400


def test_prompt_logprobs_in_responses(client: httpx.Client) -> None:
    r = complete(client, prompt_logprobs=1, n=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) > 1
        for entry in entries[1:]:
            assert 1 <= len(entry) <= 2
            for value in entry.values():
                assert set(value) == {"logprob", "rank", "decoded_token"}
    messages = [{"role": "user", "content": "Hi"}]
    c = chat(client, messages, prompt_logprobs=0)
    assert c.status_code == 200, c.text
    assert c.json()["prompt_logprobs"][0] is None and len(c.json()["prompt_logprobs"]) > 3
    negative = complete(client, prompt_logprobs=-1)
    assert negative.status_code == 400
    assert negative.json()["error"]["param"] == "prompt_logprobs"


def test_tools_without_a_parser_are_refused_but_tool_turns_render(client: httpx.Client) -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    refused = chat(client, [{"role": "user", "content": "Weather?"}], tools=[tool])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]  # fmt: skip
    r = chat(client, conversation)
    assert r.status_code == 200, r.text
    null_user = chat(client, [{"role": "user", "content": None}])
    assert null_user.status_code == 400
    assert null_user.json()["error"]["param"] == "messages[0].content"


def test_logit_bias_forces_and_forbids_tokens(client: httpx.Client) -> None:
    forced = complete(client, logit_bias={"42": 100}, logprobs=0, return_tokens_as_token_ids=True)
    assert forced.status_code == 200, forced.text
    assert token_ids(forced.json()["choices"][0]) == [42] * 6
    plain = complete(client, logprobs=0, return_tokens_as_token_ids=True).json()
    first = token_ids(plain["choices"][0])[0]
    banned = complete(
        client, logit_bias={str(first): -100}, logprobs=0, return_tokens_as_token_ids=True
    )
    assert first not in token_ids(banned.json()["choices"][0])
    # Over 100 is clamped (vLLM): still a valid request, still forcing.
    messages = [{"role": "user", "content": "Hi"}]
    r = chat(client, messages, logit_bias={"42": 1e9}, max_tokens=2, return_token_ids=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [42, 42]


def test_null_fields_take_their_defaults(client: httpx.Client) -> None:
    # OpenAI's optional fields are nullable; clients that send every field send nulls.
    nulls = dict.fromkeys(["n", "stream", "echo", "ignore_eos", "min_tokens", "stop", "seed"])
    r = complete(client, **nulls)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    messages = [{"role": "user", "content": "Hi"}]
    r = chat(client, messages, n=None, stream=None, logprobs=None, continue_final_message=None)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    required = complete(client, prompt=None)
    assert required.status_code == 400 and required.json()["error"]["param"] == "prompt"
    nested = chat(client, [{"role": None, "content": "Hi"}])
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "messages[0].role"


def test_detokenize_false_returns_no_text(client: httpx.Client) -> None:
    text = complete(client, logprobs=0, return_tokens_as_token_ids=True).json()["choices"][0]
    r = complete(client, detokenize=False, logprobs=0, return_tokens_as_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert text["text"] and choice["text"] == ""
    assert token_ids(choice) == token_ids(text)
    refused = complete(client, detokenize=False, stop=["."])
    assert refused.status_code == 400
    assert "detokenize" in refused.json()["error"]["message"]


def test_many_bad_words_keep_the_server_responsive(client: httpx.Client) -> None:
    # Their token ids were deduplicated with a list lookup per word: 30,000 words (a 300 KB
    # body) held the event loop, /health included, for half a minute. Now at most 1,024 words
    # are taken (each step scans them all), and those quickly.
    start = time.monotonic()
    r = complete(client, bad_words=[f"w{i}" for i in range(30_000)], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text
    r = complete(client, bad_words=[f"w{i}" for i in range(1024)], max_tokens=2)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 8
