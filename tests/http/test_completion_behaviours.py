"""vLLM's completion behaviours through the OpenAI SDK: each choice's finish_reason once,
prompt_logprobs only without streaming, return_token_ids, and usage only with stream_options
(include_usage defaulting to true)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.http.conftest import MODEL

pytestmark = pytest.mark.timeout(300)
PROMPT = "Write a list of animals:"
MESSAGES = [{"role": "user", "content": "Name some animals."}]
# n=3 sampled with a stop string: the choices end after different numbers of tokens.
RAGGED: dict[str, Any] = {"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 24, "stop": [","]}


def per_choice(chunks: list[Any]) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(choice)
    return out


def assert_finish_once(chunks: list[Any], n: int) -> None:
    """Every choice: finish_reason on its last chunk and on no other; then nothing more."""
    choices = per_choice(chunks)
    assert sorted(choices) == list(range(n))
    ends = []
    for index, seen in choices.items():
        reasons = [c.finish_reason for c in seen]
        assert reasons[-1] is not None, (index, reasons)
        assert all(r is None for r in reasons[:-1]), (index, reasons)
        last_chunk = max(
            i for i, ch in enumerate(chunks) if any(c.index == index for c in ch.choices)
        )
        ends.append(last_chunk)
    # The point of the test: the choices did finish at different steps.
    assert len(set(ends)) > 1, ends


def test_completion_stream_finish_once(oai: Any) -> None:
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, stream=True, **RAGGED)
    chunks = [c for c in stream if c.choices]
    assert_finish_once(chunks, 3)
    full = oai.completions.create(model=MODEL, prompt=PROMPT, **RAGGED)
    streamed = per_choice(chunks)
    for choice in full.choices:  # same seed: the stream holds the same texts, nothing twice
        assert "".join(c.text for c in streamed[choice.index]) == choice.text
        assert streamed[choice.index][-1].finish_reason == choice.finish_reason


def test_chat_stream_finish_once(oai: Any) -> None:
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **RAGGED)
    chunks = [c for c in stream if c.choices]
    assert_finish_once(chunks, 3)
    full = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **RAGGED)
    streamed = per_choice(chunks)
    for choice in full.choices:
        text = "".join(c.delta.content or "" for c in streamed[choice.index])
        assert text == choice.message.content


def test_generate_stream_sends_no_repeated_line(client: httpx.Client) -> None:
    body = {"prompt": PROMPT, **RAGGED}
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        lines = [json.loads(line)["text"] for line in response.iter_lines() if line]
    assert all(a != b for a, b in zip(lines, lines[1:], strict=False))
    final = client.post("/generate", json=body).json()["text"]
    assert lines[-1] == final
    lengths = {len(t) for t in final}
    assert len(lengths) > 1, final  # they finished at different steps


def test_prompt_logprobs_not_in_streams(oai: Any) -> None:
    for value in (1, -1):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                extra_body={"prompt_logprobs": value},
            )  # fmt: skip
        assert err.value.body["param"] == "prompt_logprobs"
        assert "not available when `stream=True`" in err.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            oai.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
                extra_body={"prompt_logprobs": value},
            )  # fmt: skip
    # 0 asks for nothing: allowed with a stream, as in vLLM.
    stream = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0}
    )
    assert [c for c in stream]
    # Non-streaming: one entry per prompt token, None first, {id: {logprob, rank, decoded}}.
    r = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, n=2, extra_body={"prompt_logprobs": 2}
    )
    for choice in r.model_dump()["choices"]:
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == r.usage.prompt_tokens
        assert all(1 <= len(e) <= 3 for e in entries[1:])
        assert {"logprob", "rank", "decoded_token"} <= set(next(iter(entries[1].values())))


def test_return_token_ids_completions(oai: Any, tokenizer: Any) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                            "n": 2, "extra_body": {"return_token_ids": True}}  # fmt: skip
    full = oai.completions.create(**args).model_dump()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    for choice in full["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    chunks = [c.model_dump() for c in oai.completions.create(stream=True, **args)]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all(c.get("prompt_token_ids") is None for c in mine[1:])
        streamed = [t for c in mine for t in c["token_ids"]]
        assert streamed == full["choices"][index]["token_ids"]
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).model_dump()
    assert plain["choices"][0]["token_ids"] is None


def test_return_token_ids_chat(oai: Any, tokenizer: Any) -> None:
    args: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                            "temperature": 0, "extra_body": {"return_token_ids": True}}  # fmt: skip
    full = oai.chat.completions.create(**args).model_dump()
    (choice,) = full["choices"]
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == full["usage"]["completion_tokens"]
    chunks = [c.model_dump() for c in oai.chat.completions.create(stream=True, **args)]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_only_with_include_usage(oai: Any, route: str) -> None:
    def run(options: dict[str, bool]) -> list[Any]:
        common: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0, "n": 2,
                                  "stream": True, "stream_options": options}  # fmt: skip
        if route == "chat":
            return list(oai.chat.completions.create(messages=MESSAGES, **common))
        return list(oai.completions.create(prompt=PROMPT, **common))

    quiet = run({"include_usage": False, "continuous_usage_stats": True})
    assert quiet and all(c.usage is None for c in quiet)
    loud = run({"include_usage": True, "continuous_usage_stats": True})
    *body, final = loud
    assert final.choices == [] and final.usage.completion_tokens == 10
    assert all(c.usage is not None for c in body)
    # vLLM's per-chunk usage: one choice's tokens so far, never beyond its 5.
    for chunk in body:
        assert 0 <= chunk.usage.completion_tokens <= 5
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens


def test_null_stream_options_mean_false(client: httpx.Client) -> None:
    # vLLM's StreamOptions fields are nullable; a null was a 400 here.
    def usages(options: dict[str, Any]) -> list[Any]:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True,
                "stream_options": options}  # fmt: skip
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e).get("usage") for e in events[:-1]]

    assert all(u is None for u in usages({"include_usage": None}))
    *body, final = usages({"include_usage": True, "continuous_usage_stats": None})
    assert all(u is None for u in body) and final["completion_tokens"] == 3


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("options", [{}, {"continuous_usage_stats": False}, {"unknown": 1}])
def test_given_stream_options_default_to_usage(
    client: httpx.Client, route: str, options: dict[str, Any]
) -> None:
    # vLLM's StreamOptions.include_usage defaults to True: only an absent or null
    # stream_options (or an explicit false or null include_usage) leaves usage out.
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
                            "stream_options": options}  # fmt: skip
    if route == "chat":
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    else:
        r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    *chunks, final = [json.loads(e) for e in events[:-1]]
    assert all(c.get("usage") is None for c in chunks)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 3
