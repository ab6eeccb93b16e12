"""The official openai SDK against the real server: completions, chat, streaming, n, logprobs,
stop, seeds, batched prompts, echo, usage, chat-template options."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.http.conftest import ALIAS, MODEL, sse_events

pytestmark = pytest.mark.timeout(300)
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_models_lists_every_served_name(oai: Any) -> None:
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL, ALIAS]


def test_completion_greedy(oai: Any) -> None:
    out = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert out.object == "text_completion"
    assert out.model == MODEL
    choice = out.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = oai.completions.create(
        model=ALIAS, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == choice.text
    assert again.model == ALIAS


def test_completion_length_and_ignore_eos(oai: Any) -> None:
    out = oai.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 12},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12


def test_completion_stop_string(oai: Any) -> None:
    base = oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert " 5" in text, text
    out = oai.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=16, temperature=0, stop=[" 5"]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(" 5")]
    assert " 5" not in out.choices[0].text


def test_completion_n_and_seed_reproducible(oai: Any) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=2)
    a = oai.completions.create(seed=1234, **kwargs)
    b = oai.completions.create(seed=1234, **kwargs)
    c = oai.completions.create(seed=99, **kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1]
    texts_a = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    texts_b = [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    texts_c = [ch.text for ch in sorted(c.choices, key=lambda ch: ch.index)]
    assert texts_a == texts_b
    assert texts_a != texts_c
    assert texts_a[0] != texts_a[1]  # the two samples differ
    assert 2 <= a.usage.completion_tokens <= 20  # both choices counted


def test_completion_logprobs_and_echo(oai: Any) -> None:
    out = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 2 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert token in top and top[token] == pytest.approx(max(top.values()))
    echo = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    choice = echo.choices[0]
    assert choice.text == "The sky is" + out.choices[0].text
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(lp.tokens) == 3 + 4
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == choice.text


def test_echo_with_max_tokens_0_scores_the_prompt(oai: Any, client: httpx.Client) -> None:
    # How evaluation harnesses score a text: the prompt back with its logprobs, nothing more.
    full = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=1, echo=True
    ).choices[0]
    out = oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    assert choice.text == "The sky is"
    assert choice.logprobs.tokens == full.logprobs.tokens[:3]
    assert choice.logprobs.token_logprobs == full.logprobs.token_logprobs[:3]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 0
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 0, "echo": True, "stream": True}
    raw = client.post("/v1/completions", json={**body, "logprobs": 1}).text
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The sky is"
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == full.logprobs.tokens[:3]
    plain = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert plain["choices"][0]["text"] == "The sky is"
    no_echo = client.post("/v1/completions", json={**body, "echo": False, "stream": False})
    assert no_echo.status_code == 400 and no_echo.json()["error"]["param"] == "max_tokens"


def test_batched_prompts(oai: Any) -> None:
    out = oai.completions.create(
        model=MODEL,
        prompt=["The capital of France is", "1, 2, 3,"],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1]  # greedy: both samples agree
    assert by_index[2] == by_index[3]
    assert by_index[0] != by_index[2]
    single = oai.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert single.choices[0].text == by_index[2]


def test_token_id_prompts(oai: Any, tokenizer: Any) -> None:
    texts = ["Hello, my name is", "The capital of France is"]
    by_text = oai.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0)
    ids = [tokenizer.encode(t) for t in texts]
    one = oai.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    many = oai.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    expected = [c.text for c in sorted(by_text.choices, key=lambda c: c.index)]
    assert one.choices[0].text == expected[0]
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == expected
    assert one.usage.prompt_tokens == len(ids[0])
    echo = oai.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith(texts[1])


def test_completion_streaming_with_usage(oai: Any) -> None:
    full = oai.completions.create(
        model=MODEL, prompt="Water boils at", max_tokens=12, temperature=0
    )
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt="Water boils at",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert (
        not chunks[-1].choices
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_chat(oai: Any) -> None:
    out = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant"
    assert msg.content and any(c in msg.content.lower() for c in ("red", "blue", "green"))
    assert out.usage.prompt_tokens > 10  # the chat template wraps the message


def test_chat_prompt_is_the_models_template(oai: Any, tokenizer: Any) -> None:
    for messages in (CHAT, [{"role": "system", "content": "You answer in French."}, *CHAT]):
        out = oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, temperature=0
        )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert "You answer in French." in text or messages is CHAT
        assert out.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_max_completion_tokens_and_stop(oai: Any) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 20, comma separated."}],
        max_completion_tokens=5,
        temperature=0,
    )
    assert out.usage.completion_tokens <= 5
    assert out.choices[0].finish_reason == "length"


def test_chat_streaming_matches_non_streaming(oai: Any) -> None:
    full = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_n_logprobs(oai: Any) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0.8,
        seed=7,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert content and len(content) <= 6
        assert "".join(e.token for e in content) == choice.message.content
        for entry in content:
            assert entry.logprob <= 0
            assert bytes(entry.bytes) == entry.token.encode()
            assert len(entry.top_logprobs) == 3
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)


def test_chat_continue_final_message(oai: Any) -> None:
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    out = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "Paris" in out.choices[0].message.content


def test_extra_sampling_fields(oai: Any) -> None:
    out = oai.completions.create(
        model=MODEL,
        prompt="The three primary colors are",
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "skip_special_tokens": True,
            "stop_token_ids": [2],
        },
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.completion_tokens >= 1
