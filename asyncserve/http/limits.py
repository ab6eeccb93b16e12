"""Limits that keep one request from hurting the others: a thread pool for CPU-heavy
preprocessing, a size bound on prompts before tokenization, a JSON nesting bound, a body
read deadline and atomic admission against --max-waiting-requests."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from starlette.requests import Request

from asyncserve.http.errors import APIError

T = TypeVar("T")

# A prompt longer than max_model_len * this many characters cannot fit: no tokenizer in use
# averages more than ~8 characters per token on real text (English BPE: ~4), so it is
# rejected before it is tokenized. Prompts with truncate_prompt_tokens are exempt.
MAX_CHARS_PER_TOKEN = 8
# Body limit when --max-request-body-bytes is not given: what max_model_len can use with
# every character JSON-escaped (\uXXXX, 6 bytes), with a floor for batches and tools.
BODY_BYTES_PER_TOKEN = MAX_CHARS_PER_TOKEN * 6
MIN_BODY_BYTES = 1024 * 1024
# Deepest JSON nesting accepted in a body or a JSON schema given as a string; deeper input
# would exhaust the decoder's recursion (a 500) for no real use.
MAX_JSON_DEPTH = 128
# Threads for tokenizing, chat templating and grammar compiling (they release the GIL
# mostly; more threads than this only queue behind the cores).
PREPROCESS_THREADS = 2

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def default_body_limit(max_model_len: int, max_images: int = 0, image_bytes: int = 0) -> int:
    """The text's room plus, for a model that takes images, the largest data: URLs its
    prompts may carry (base64: 4 characters per 3 bytes), so a body limit never refuses an
    image the media limits accept."""
    images = max_images * (-(-image_bytes // 3) * 4 + 256)
    return max(MIN_BODY_BYTES, max_model_len * BODY_BYTES_PER_TOKEN) + images


def max_prompt_chars(max_model_len: int) -> int:
    return max_model_len * MAX_CHARS_PER_TOKEN


def check_prompt_chars(text: str, max_model_len: int, param: str = "prompt") -> None:
    """400 before tokenizing a prompt too long to fit in max_model_len tokens."""
    limit = max_prompt_chars(max_model_len)
    if len(text) > limit:
        raise APIError(
            f"the prompt has {len(text)} characters, more than max_model_len "
            f"({max_model_len}) x {MAX_CHARS_PER_TOKEN} characters per token = {limit} can "
            "hold; shorten it or set truncate_prompt_tokens",
            400,
            param,
        )


def json_depth(raw: bytes | str) -> int:
    """The deepest nesting of arrays and objects in a JSON text (strings skipped); up to
    MAX_JSON_DEPTH it may overestimate, which is all the check needs."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    opened = data.count(b"[") + data.count(b"{")
    if opened <= MAX_JSON_DEPTH:  # cannot be deeper: skip the slower scan
        return opened
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(itertools.accumulate(_STEP[b] for b in brackets))


def check_json_depth(raw: bytes | str, what: str = "the request body") -> None:
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(f"{what} is nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}", 400)


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than the limit of {limit} bytes", 413)


async def read_body(request: Request, limit: int, timeout_s: float | None) -> bytes:
    """The whole body: 413 over `limit` bytes (at once when Content-Length says so), 408 when
    it takes longer than `timeout_s` (a slow client holds a connection and a task),
    ClientDisconnect when the client left."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError("Content-Length must be a non-negative integer", 400)
        if int(declared) > limit:
            raise too_large(limit)
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise too_large(limit)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise APIError(
            f"the request body was not received within {timeout_s:g} s (--timeout-request-body)",
            408,
            headers={"Connection": "close"},
        ) from None
    return bytes(body)


class Preprocessor:
    """A bounded pool for tokenizing, templating and grammar compiling off the event loop."""

    def __init__(self, threads: int = PREPROCESS_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="asyncserve-prep")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Ticket:
    """Places held in the waiting count for requests admitted but not yet added to the
    engine; each goes back once its request is added, or when the ticket is dropped."""

    def __init__(self, admission: Admission, count: int) -> None:
        self._admission = admission
        self._held = count

    def release(self, count: int = 1) -> None:
        count = min(count, self._held)
        self._held -= count
        self._admission.pending -= count

    def __del__(self) -> None:
        self.release(self._held)

    def watch(self, stream: AsyncIterator[T]) -> AsyncIterator[T]:
        """`stream`, giving this request's place back once the engine has added it (from
        then on the engine's waiting count includes it)."""
        return WatchedStream(self, stream)


class WatchedStream(Generic[T]):
    """An engine output stream that gives its ticket's place back after the first step.

    Past the first item, `__anext__` is the stream's own awaitable: a streamed token goes
    through no extra frame here. Close it (`aclose`, as `sse.closing` does) to abort."""

    def __init__(self, ticket: Ticket, stream: AsyncIterator[T]) -> None:
        self._ticket = ticket
        self._stream = stream
        self._first: asyncio.Future[T] | None = None
        self._started = False

    def __aiter__(self) -> WatchedStream[T]:
        return self

    def __anext__(self) -> Awaitable[T]:
        if self._started:
            return self._stream.__anext__()
        self._started = True
        return self._first_item()

    async def _first_item(self) -> T:
        # The engine adds the request in the first step of the first __anext__; one pass of
        # the loop runs that step, so the place can go back right after it.
        first = self._first = asyncio.ensure_future(self._stream.__anext__())
        try:
            await asyncio.sleep(0)
            self._ticket.release()
            return await first  # StopAsyncIteration (no output at all) ends the iteration
        except BaseException:
            await self._drop_first()
            raise

    async def _drop_first(self) -> None:
        first = self._first
        if first is not None and not first.done():
            first.cancel()
            with contextlib.suppress(BaseException):
                await first

    async def aclose(self) -> None:
        self._ticket.release()
        await self._drop_first()
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()


class Admission:
    """Counts requests admitted and not yet scheduled, so that the check against
    --max-waiting-requests and the count are one step (no await between them)."""

    def __init__(self) -> None:
        self.pending = 0

    def admit(self, engine_waiting: int, limit: int | None, count: int = 1) -> Ticket:
        # Admitted requests the engine has not added yet, and those it has and not scheduled.
        waiting = engine_waiting + self.pending
        if limit is not None and waiting + count > limit:
            raise APIError(
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting-requests {limit}); retry later",
                503,
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.pending += count
        return Ticket(self, count)
