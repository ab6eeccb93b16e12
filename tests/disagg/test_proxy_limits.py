"""The proxy reads bodies as the server does: 413 over its limit before reading it all, 408
for a body sent too slowly, 400 for nesting past the JSON limit; nothing reaches an instance."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from asyncserve.disagg.proxy import build_proxy
from asyncserve.http.limits import MAX_JSON_DEPTH

LIMIT = 4096
# Nothing listens here: a request that got past the body checks would answer 503.
NOWHERE = "http://127.0.0.1:9"


def _client(body_timeout_s: float | None = 5.0) -> httpx.AsyncClient:
    app = build_proxy([NOWHERE], [NOWHERE], body_limit=LIMIT, body_timeout_s=body_timeout_s)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


def test_declared_length_over_the_limit_is_413_before_reading() -> None:
    sent: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(1000):
            sent.append(i)
            yield b" " * 1024

    async def go() -> httpx.Response:
        async with _client() as client:
            headers = {"content-length": str(1000 * 1024), "content-type": "application/json"}
            return await client.post("/v1/completions", content=body(), headers=headers)

    reply = asyncio.run(go())
    assert reply.status_code == 413
    assert f"larger than the limit of {LIMIT} bytes" in reply.json()["error"]["message"]
    assert len(sent) <= 1


def test_chunked_body_over_the_limit_is_413_after_the_limit() -> None:
    sent: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(1000):
            sent.append(i)
            yield b" " * 1024

    async def go() -> httpx.Response:
        async with _client() as client:
            return await client.post("/v1/chat/completions", content=body())

    reply = asyncio.run(go())
    assert reply.status_code == 413
    assert len(sent) < 10  # stopped reading soon past LIMIT, not after 1 MB


def test_slow_body_is_408() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"prompt": '
        await asyncio.sleep(5)
        yield b'"x"}'

    async def go() -> httpx.Response:
        async with _client(body_timeout_s=0.2) as client:
            return await client.post("/v1/completions", content=body())

    reply = asyncio.run(go())
    assert reply.status_code == 408
    assert "--timeout-request-body" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), 400, "nested"),
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"prompt": "hi"}', 503, "no decode instance"),
    ],
)
def test_bad_bodies_are_400_and_a_good_one_goes_on(content: bytes, status: int, words: str) -> None:
    async def go() -> httpx.Response:
        async with _client() as client:
            return await client.post("/v1/completions", content=content)

    reply = asyncio.run(go())
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]


def test_proxy_flags_parse() -> None:
    import argparse

    from asyncserve.disagg.proxy import add_proxy_arguments

    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    args = parser.parse_args(["--prefill", NOWHERE, "--decode", NOWHERE,
                              "--max-request-body-bytes", "2M", "--timeout-request-body", "0"])  # fmt: skip
    assert args.max_request_body_bytes == 2 * 1024 * 1024
    assert args.timeout_request_body is None
