"""asyncserve.http.limits without a server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from asyncserve.http.errors import APIError
from asyncserve.http.limits import (
    MAX_JSON_DEPTH,
    Admission,
    check_json_depth,
    check_prompt_chars,
    default_body_limit,
)


def test_admission_counts_what_the_engine_has_not_seen() -> None:
    admission = Admission()
    tickets = [admission.admit(engine_waiting=0, limit=3) for _ in range(3)]
    with pytest.raises(APIError) as info:
        admission.admit(engine_waiting=0, limit=3)
    assert info.value.status == 503
    assert info.value.headers == {"Retry-After": "1"}
    tickets[0].release()
    tickets.append(admission.admit(engine_waiting=0, limit=3))
    with pytest.raises(APIError):
        admission.admit(engine_waiting=1, limit=3)  # one already in the engine's queue
    del tickets
    assert admission.pending == 0  # dropped tickets give their places back


def test_ticket_watch_releases_once_the_stream_started() -> None:
    async def stream() -> AsyncIterator[int]:
        yield 1
        yield 2

    async def main() -> None:
        admission = Admission()
        ticket = admission.admit(0, None, count=1)
        items = [i async for i in ticket.watch(stream())]
        assert items == [1, 2]
        assert admission.pending == 0

    asyncio.run(main())


def test_ticket_watch_cancelled_before_the_first_output_cleans_up() -> None:
    """A client gone while the request waits for its first step: the place goes back, the
    pending first read is cancelled and closing the stream closes the engine's."""
    events: list[str] = []

    async def stream() -> AsyncIterator[int]:
        try:
            await asyncio.sleep(10)
            yield 1
        finally:
            events.append("engine stream closed")

    async def main() -> None:
        admission = Admission()
        ticket = admission.admit(0, None, count=1)
        watched = ticket.watch(stream())
        reader = asyncio.ensure_future(watched.__anext__())
        await asyncio.sleep(0.01)
        assert admission.pending == 0  # released after the first pass of the loop
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert events == ["engine stream closed"]  # the first read was cancelled with it
        await watched.aclose()  # type: ignore[attr-defined]
        assert admission.pending == 0

    asyncio.run(main())


def test_ticket_watch_of_an_empty_stream_ends() -> None:
    async def stream() -> AsyncIterator[int]:
        return
        yield  # an async generator with no items

    async def main() -> None:
        admission = Admission()
        ticket = admission.admit(0, None, count=1)
        assert [i async for i in ticket.watch(stream())] == []
        assert admission.pending == 0

    asyncio.run(main())


def test_bounds() -> None:
    check_prompt_chars("a" * 16, 2)
    with pytest.raises(APIError, match="characters per token"):
        check_prompt_chars("a" * 17, 2)
    assert default_body_limit(2048) == 1024 * 1024
    assert default_body_limit(131072) == 131072 * 48
    check_json_depth("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    with pytest.raises(APIError, match=f"the limit is {MAX_JSON_DEPTH}"):
        check_json_depth(b'{"a": ' + b"[" * 1000 + b"]" * 1000 + b"}")
