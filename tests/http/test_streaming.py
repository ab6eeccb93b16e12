"""Raw SSE and NDJSON framing, /generate, client disconnects, and 64 concurrent streams."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.http.conftest import API_KEY, MODEL, ServerProcess, sse_events, wait_idle

pytestmark = pytest.mark.timeout(300)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_sse_framing_completions(client: httpx.Client) -> None:
    body = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "stream": True,
            "n": 2, "stream_options": {"include_usage": True}}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
    per_choice: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert "usage" not in chunk
        (choice,) = chunk["choices"]
        per_choice[choice["index"]].append(choice)
    for choices in per_choice.values():
        assert choices and choices[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
    assert usage["usage"]["completion_tokens"] == 12
    assert per_choice[0] and "".join(c["text"] for c in per_choice[0]) == "".join(
        c["text"] for c in per_choice[1]
    )  # greedy: both samples agree


def test_sse_framing_chat(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5,
            "temperature": 0, "stream": True}  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage chunk


def test_generate_legacy(client: httpx.Client) -> None:
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    texts = response.json()["text"]
    assert len(texts) == 2 and texts[0] == texts[1]
    assert texts[0].startswith(prompt) and len(texts[0]) > len(prompt)
    completion = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}
    ).json()
    assert texts[0] == prompt + completion["choices"][0]["text"]


def test_generate_streaming_ndjson(client: httpx.Client) -> None:
    prompt = "Water boils at"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    with client.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    final = client.post("/generate", json={**body, "stream": False}).json()
    assert len(lines) >= 2
    texts = [line["text"][0] for line in lines]
    assert all(t.startswith(prompt) for t in texts)
    assert all(a == b[: len(a)] for a, b in zip(texts, texts[1:], strict=False))  # cumulative
    assert texts[-1] == final["text"][0]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ,":
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_disconnect_aborts_and_frees_the_pool(server: ServerProcess, client: httpx.Client) -> None:
    aborted_before = _metric(
        client.get("/metrics").text, 'asyncserve:request_success_total{finished_reason="abort"'
    )
    body = {"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with (
        httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as own,
        own.stream("POST", "/v1/completions", json=body) as response,
    ):
        # Keep the line iterator referenced: a dropped iterator closes the connection.
        lines = response.iter_lines()
        events: list[str] = []
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        assert len(events) == 3 and "error" not in events[-1], events
        health_now = client.get("/health").json()
        assert health_now["num_running"] == 1, (health_now, events)
    # Leaving the block closed the connection mid-stream.
    closed = time.monotonic()
    health = wait_idle(client, timeout=10)
    assert time.monotonic() - closed < 5.0
    assert health["num_free_blocks"] == health["num_total_blocks"], health
    metrics = client.get("/metrics").text
    assert _metric(metrics, "asyncserve:kv_cache_usage_perc") == 0.0
    aborted = _metric(metrics, 'asyncserve:request_success_total{finished_reason="abort"')
    assert aborted == aborted_before + 1


def test_disconnect_during_non_streaming_request(
    server: ServerProcess, client: httpx.Client
) -> None:
    body = {"prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    health = wait_idle(client, timeout=10)
    assert health["num_free_blocks"] == health["num_total_blocks"], health


def test_64_concurrent_streams(server: ServerProcess, client: httpx.Client) -> None:
    async def one(http: httpx.AsyncClient, i: int) -> tuple[str, int]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {i}."}],
                "max_tokens": 8, "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            raw = (await response.aread()).decode()
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        return text, chunks[-1]["usage"]["completion_tokens"]

    async def run() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=AUTH, timeout=240, limits=limits
        ) as http:
            return await asyncio.gather(*(one(http, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(1 <= tokens <= 8 for _, tokens in results)
    assert sum(bool(text) for text, _ in results) >= 60
    health = wait_idle(client)
    assert health["num_free_blocks"] == health["num_total_blocks"]
