"""Pure pieces of the HTTP layer: error mapping, prompt parsing, stream merging, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from asyncserve.http.errors import APIError, from_validation_error, from_value_error
from asyncserve.http.protocol import ChatCompletionRequest, CompletionRequest
from asyncserve.http.serving import parse_prompts
from asyncserve.http.sse import ClientDisconnected, cancel_on_disconnect, merge_streams, sse_event


def _decode_error(raw: bytes, body_type: Any) -> APIError:
    try:
        msgspec.json.decode(raw, type=body_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return from_validation_error(exc)
    raise AssertionError("decoded")


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": "x", "temperature": "a"}', "temperature"),
        (b'{"temperature": 1}', "prompt"),
        (b'{"prompt": "x", "stop": ["a", 3]}', "stop[1]"),
        (b"[]", None),
        (b"{", None),
    ],
)
def test_validation_errors_name_the_field(raw: bytes, param: str | None) -> None:
    error = _decode_error(raw, CompletionRequest)
    assert error.status == 400 and error.param == param


def test_nested_missing_field() -> None:
    error = _decode_error(b'{"messages": [{"content": "x"}]}', ChatCompletionRequest)
    assert error.param == "messages[0].role"
    assert "role" in error.message


@pytest.mark.parametrize(
    ("message", "default", "renames", "param", "said"),
    [
        ("top_p must be in (0, 1], got 2", None, None, "top_p", "top_p must"),
        ("logprobs must be an integer in [0, 20], got 30", None, {"logprobs": "top_logprobs"},
         "top_logprobs", "top_logprobs must"),
        ("max_tokens: too many", "prompt", {"max_tokens": "max_completion_tokens"},
         "max_completion_tokens", "max_completion_tokens: too many"),
        # A renamed field is named as the client sent it, in the message too.
        ("min_tokens must be <= max_tokens (2), got 5", None,
         {"max_tokens": "max_completion_tokens"}, "min_tokens",
         "min_tokens must be <= max_completion_tokens (2), got 5"),
        ("structured_outputs.json: bad", None, {"structured_outputs": "guided_json"},
         "guided_json", "structured_outputs.json: bad"),
        ("prompt has 3000 tokens", "messages", {"prompt": "messages"}, "messages", "prompt has"),
        ("something else broke", "prompt", None, "prompt", "something else broke"),
    ],
)  # fmt: skip
def test_value_errors_map_to_fields(
    message: str, default: str | None, renames: dict[str, str] | None, param: str, said: str
) -> None:
    error = from_value_error(ValueError(message), default, renames)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(said), error.message


@pytest.mark.parametrize(
    ("message", "tag"),
    [
        ("n must be an integer >= 1, got 0", " [type=greater_than_equal]"),
        ("top_p must be in (0, 1], got 2", " [type=less_than_equal]"),
        ("top_p must be in (0, 1], got 0", " [type=greater_than]"),
        ("min_p must be in [0, 1], got -0.5", " [type=greater_than_equal]"),
        ("Expected `int` <= 2147483647", " [type=less_than_equal]"),
        ("prompt must not be empty", ""),
    ],
)  # fmt: skip
def test_out_of_range_errors_name_the_constraint(message: str, tag: str) -> None:
    # vLLM's 400s carry pydantic's names for the bound; clients match on them.
    assert from_value_error(ValueError(message), None).message == message + tag


def test_error_body_shape() -> None:
    body = msgspec.json.decode(msgspec.json.encode(APIError("bad", 400, "n").to_body()))
    assert body == {"error": {"message": "bad", "type": "BadRequestError", "param": "n",
                              "code": 400}}  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_parse_prompts(prompt: Any, expected: list[Any]) -> None:
    assert parse_prompts(prompt) == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[]], [True], [[1], 2], [-1], [1.5]])
def test_parse_prompts_rejects(prompt: Any) -> None:
    with pytest.raises(APIError) as exc:
        parse_prompts(prompt)
    assert exc.value.param == "prompt"


def test_sse_event_framing() -> None:
    assert sse_event({"a": "x\ny"}) == b'data: {"a":"x\\ny"}\n\n'


def test_merge_streams_interleaves_and_closes_everything() -> None:
    closed: list[int] = []

    async def numbers(tag: int, delay: float) -> AsyncIterator[int]:
        try:
            for i in range(3):
                await asyncio.sleep(delay)
                yield tag * 10 + i
        finally:
            closed.append(tag)

    async def main() -> None:
        seen = [item async for item in merge_streams([numbers(1, 0.001), numbers(2, 0.003)])]
        assert sorted(v for _, v in seen) == [10, 11, 12, 20, 21, 22]
        assert [v for i, v in seen if i == 0] == [10, 11, 12]  # each stream keeps its order
        assert sorted(closed) == [1, 2]
        closed.clear()
        merged = merge_streams([numbers(1, 0.001), numbers(2, 10)])
        assert (await merged.__anext__()) == (0, 10)
        await merged.aclose()  # a client that went away: both streams are closed now
        assert sorted(closed) == [1, 2]

    asyncio.run(main())


def test_cancel_on_disconnect() -> None:
    cleaned: list[str] = []

    async def work(seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
            return "done"
        finally:
            cleaned.append("work")

    def receive_after(seconds: float) -> Any:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(seconds)
            return {"type": "http.disconnect"}

        return receive

    async def main() -> None:
        assert await cancel_on_disconnect(work(0.01), receive_after(10)) == "done"
        with pytest.raises(ClientDisconnected):
            await cancel_on_disconnect(work(10), receive_after(0.01))
        assert cleaned == ["work", "work"]  # the abandoned work was cancelled and cleaned up

    asyncio.run(main())


def test_event_stream_keepalive_and_completion() -> None:
    from asyncserve.http.sse import KEEPALIVE, EventStreamResponse

    async def slow() -> AsyncIterator[bytes]:
        await asyncio.sleep(0.35)
        yield b"data: 1\n\n"

    async def main() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(10)  # the client stays
            return {"type": "http.disconnect"}

        response = EventStreamResponse(slow(), keepalive_s=0.1)
        await response({"type": "http"}, receive, send)  # type: ignore[arg-type]
        return sent

    sent = asyncio.run(main())
    bodies = [m.get("body") for m in sent[1:]]
    assert sent[0]["type"] == "http.response.start"
    assert bodies.count(KEEPALIVE) >= 2  # the idle stretch got comments
    assert bodies[-2:] == [b"data: 1\n\n", b""]  # data, then the end; nothing after it
    assert sent[-1]["more_body"] is False


def test_event_stream_disconnect_cancels_the_body() -> None:
    from asyncserve.http.sse import EventStreamResponse

    closed: list[bool] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield b"data: x\n\n"
        finally:
            closed.append(True)

    async def main() -> None:
        async def send(message: dict[str, Any]) -> None:
            pass

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

        await EventStreamResponse(endless())({"type": "http"}, receive, send)  # type: ignore[arg-type]

    asyncio.run(main())
    assert closed == [True]


def test_event_stream_body_goes_to_the_servers_own_send() -> None:
    """The start goes through the middlewares (they add headers); body messages skip them."""
    from asyncserve.http.sse import RAW_SEND_KEY, EventStreamResponse

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"

    async def main() -> tuple[list[str], list[str]]:
        wrapped: list[str] = []
        raw: list[str] = []

        async def server_send(message: dict[str, Any]) -> None:
            raw.append(message["type"])

        async def middleware_send(message: dict[str, Any]) -> None:
            wrapped.append(message["type"])
            await server_send(message)

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        scope = {"type": "http", RAW_SEND_KEY: server_send}
        await EventStreamResponse(body())(scope, receive, middleware_send)  # type: ignore[arg-type]
        return wrapped, raw

    wrapped, raw = asyncio.run(main())
    assert wrapped == ["http.response.start"]
    assert raw == ["http.response.start", "http.response.body", "http.response.body"]
