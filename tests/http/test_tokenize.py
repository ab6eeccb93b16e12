"""vLLM's /tokenize and /detokenize on the real server: a prompt, chat messages through the
chat template, token strings, the round trip, and 400s naming the field."""

from __future__ import annotations

from typing import Any

import httpx

from tests.http.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Hello there"}]


def test_tokenize_a_prompt_and_back(client: httpx.Client, tokenizer: Any) -> None:
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tokenizer.encode("Hello world", add_special_tokens=True)
    assert body == {
        "count": len(expected),
        "max_model_len": 2048,
        "tokens": expected,
        "token_strs": None,
    }
    strs = client.post(
        "/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    back = client.post("/detokenize", json={"model": MODEL, "tokens": strs["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}


def test_tokenize_chat_messages_as_the_chat_route_does(
    client: httpx.Client, tokenizer: Any
) -> None:
    with_prompt = client.post("/tokenize", json={"messages": MESSAGES}).json()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert with_prompt["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    without = client.post(
        "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert without["count"] < with_prompt["count"]
    assert with_prompt["tokens"][: without["count"]] == without["tokens"]
    back = client.post("/detokenize", json={"tokens": with_prompt["tokens"]}).json()
    assert back == {"prompt": text}  # special tokens included, as in vLLM
    # The same count as the chat completion's prompt_tokens.
    chat = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == with_prompt["count"]


def test_bad_tokenize_requests_name_the_field(client: httpx.Client) -> None:
    cases = [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]
    for path, body, param in cases:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, (path, body, r.json())
