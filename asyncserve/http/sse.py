"""Server-sent events: framing, a streaming response that notices a client going away, and
the same disconnect watch for non-streaming requests.

A disconnect cancels the task consuming the engine's `generate()` iterator; the iterator's
cleanup aborts the request inside the engine, so its KV blocks go back to the pool at the
next step. Uvicorn (ASGI spec 2.3) drops writes to a closed connection silently, so the
response listens for `http.disconnect` itself instead of waiting for a failed send.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, TypeVar

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from asyncserve.http.errors import APIError

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()
encode_json = _encoder.encode


def sse_event(payload: Any) -> bytes:
    """One `data:` event holding `payload` as JSON (msgspec Structs, dicts, lists)."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def ndjson_line(payload: Any) -> bytes:
    return _encoder.encode(payload) + b"\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (or the response is complete)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _finish(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def shutdown_error() -> APIError:
    """What a request cut by the server's shutdown deadline answers."""
    return APIError("the server is shutting down (--shutdown-timeout ran out)", 503)


async def cancel_on_disconnect(
    work: Awaitable[T], receive: Receive, scope: Scope | None = None
) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected.
    With the request's `scope`, the server's shutdown deadline cuts it too: cancelled, then
    shutdown_error() (a JSON 503, where uvicorn would cancel the handler a moment later
    into a plain-text 500)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    waits: set[asyncio.Future[Any]] = {task, watch}
    deadline = _shutdown_deadline(scope) if scope is not None else None
    if deadline is not None:
        waits.add(deadline)  # shared by every request: never cancelled here
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _finish(task, watch)
        raise
    if task.done():
        await _finish(watch)
        return task.result()
    if watch.done():
        await _finish(task)
        raise ClientDisconnected
    await _finish(task, watch)
    raise shutdown_error()


# A comment line every this many idle seconds keeps proxies from closing a quiet stream
# (a request waiting in the queue, a long prefill).
KEEPALIVE_S = 15.0
KEEPALIVE = b": keep-alive\n\n"

# Where the app puts the server's own `send` in the scope (app.py). A stream's body messages
# go straight to it: every middleware here only looks at (or adds headers to) the response
# start, so for body messages each layer is a pass-through await, a tenth of the CPU a
# streamed token cost. A middleware that rewrites bodies would have to drop this key.
RAW_SEND_KEY = "asyncserve.raw_send"


class EventStreamResponse(Response):
    """Streams an async iterator of byte chunks; a client disconnect cancels the iterator.

    With `keepalive_s`, an idle stream gets a comment event that often (SSE only: clients
    ignore lines starting with ':'). Per stream: one task pumps the body and one watches
    for the client going away; the keep-alive is a timer, the shutdown deadline one waiter
    shared by every stream.
    """

    def __init__(
        self,
        body: AsyncIterator[bytes],
        media_type: str = "text/event-stream",
        headers: Mapping[str, str] | None = None,
        status_code: int = 200,
        keepalive_s: float | None = KEEPALIVE_S,
    ) -> None:
        self.body_iterator = body
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.keepalive_s = keepalive_s
        all_headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        all_headers.update(headers or {})
        self.init_headers(all_headers)
        self._complete = False  # the response is over: no more keep-alives
        self._pumped = False  # the whole body went out
        self._last_send = 0.0
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._keepalive_sends: set[asyncio.Future[Any]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        send = scope.get(RAW_SEND_KEY, send)
        loop = asyncio.get_running_loop()
        self._last_send = loop.time()
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        waits: set[asyncio.Future[Any]] = {pump, watch}
        deadline = _shutdown_deadline(scope)
        if deadline is not None:
            waits.add(deadline)
        if self.keepalive_s is not None:
            self._arm_keepalive(send, self.keepalive_s, self.keepalive_s)
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._complete = True
            if self._keepalive_timer is not None:
                self._keepalive_timer.cancel()
            # Cancelling the pump runs the body iterator's cleanup: the engine aborts.
            await _finish(pump, watch, *self._keepalive_sends)
        if pump.cancelled():
            if deadline is not None and deadline.done() and not self._pumped:
                await self._send_cut(send)
            return
        exc = pump.exception()
        if exc is not None and not isinstance(exc, OSError):
            raise exc

    async def _send_cut(self, send: Send) -> None:
        """The server's shutdown deadline passed: end the stream with an error the client
        can read (then [DONE] on SSE) instead of a broken chunked body."""
        error = shutdown_error().to_body()
        tail = sse_event(error) + DONE if self.media_type == "text/event-stream" else b""
        if self.media_type != "text/event-stream":
            tail = ndjson_line(error)
        with contextlib.suppress(Exception):  # the client may be gone too
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _pump(self, send: Send) -> None:
        body = self.body_iterator
        loop = asyncio.get_running_loop()
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._last_send = loop.time()
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        self._pumped = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _arm_keepalive(self, send: Send, interval: float, delay: float) -> None:
        """Check in `delay` s whether the stream has been idle `interval` s; if so, send a
        comment. A timer, not a task: most streams never need one."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            if self._complete or self._pumped:
                return
            idle = loop.time() - self._last_send
            if idle >= interval:
                if not self._keepalive_sends:  # else the last one still waits to drain
                    task = asyncio.ensure_future(self._send_keepalive(send))
                    self._keepalive_sends.add(task)
                    task.add_done_callback(self._keepalive_sends.discard)
                idle = 0.0
            self._arm_keepalive(send, interval, interval - idle)

        self._keepalive_timer = loop.call_later(delay, check)

    async def _send_keepalive(self, send: Send) -> None:
        try:
            await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
        except (RuntimeError, OSError):  # the pump ended the response while this send waited
            return
        self._last_send = asyncio.get_running_loop().time()


def _shutdown_deadline(scope: Scope) -> asyncio.Future[Any] | None:
    """Done once the server's --shutdown-timeout ran out after SIGTERM (ServerState); shared
    by every stream, so a stream must never cancel it."""
    app_state = getattr(scope.get("app"), "state", None)
    server_state = getattr(app_state, "asyncserve", None)
    waiter = getattr(server_state, "shutdown_deadline_waiter", None)
    return waiter() if callable(waiter) else None


_END = object()


async def merge_streams(
    streams: list[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive: (which stream, item).

    Closing the merged iterator (or an error in one stream) cancels every stream.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await aclose_all(streams)
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue(
        maxsize=2 * len(streams)
    )

    async def drain(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item, None))
        except Exception as exc:
            await queue.put((index, _END, exc))
            return
        await queue.put((index, _END, None))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield index, item
    finally:
        await _finish(*tasks)
        await aclose_all(streams)


@contextlib.asynccontextmanager
async def closing(stream: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """`async with closing(engine.generate(...)) as outputs`: closed on exit, even on break."""
    try:
        yield stream
    finally:
        await aclose_all([stream])


async def aclose_all(streams: list[AsyncIterator[T]]) -> None:
    """Close async generators now (not at garbage collection): their cleanup aborts requests."""
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
