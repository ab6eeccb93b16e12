"""One streaming HTTP request per connection, read with a bare asyncio protocol and httptools.

No HTTP client library sits between the socket and the benchmark: each socket read is one
`data_received` call, parsed by httptools (C, handles chunked encoding) and split into SSE
events. That keeps the client's cost per event to a few microseconds, so that hundreds of
concurrent streams measure the server and not the client. Every request opens its own
connection (`Connection: close`), which is what a burst of new clients does too.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import msgspec

from asyncserve.bench.sse import DONE, SSEReader, decode_chunk


@dataclass
class RequestRecord:
    """What one request measured; times in seconds, `start` from the benchmark's start."""

    prompt_len: int
    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class ReadStats:
    """Socket reads and SSE events seen by one client process."""

    reads: int = 0
    events: int = 0


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path: str
    ssl: ssl.SSLContext | None

    @classmethod
    def parse(cls, base_url: str, path: str) -> Endpoint:
        url = urlsplit(base_url)
        secure = url.scheme == "https"
        port = url.port or (443 if secure else 80)
        prefix = url.path.rstrip("/")
        context = ssl.create_default_context() if secure else None
        return cls(url.hostname or "127.0.0.1", port, prefix + path, context)


def build_request(endpoint: Endpoint, payload: dict[str, Any], headers: dict[str, str]) -> bytes:
    """The whole HTTP/1.1 request, encoded before the run so the run only writes it."""
    body = msgspec.json.encode(payload)
    lines = [
        f"POST {endpoint.path} HTTP/1.1",
        f"Host: {endpoint.host}:{endpoint.port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _StreamProtocol(asyncio.Protocol):
    """Feeds each read to httptools; the parser calls back on_headers_complete/on_body/..."""

    def __init__(self, record: RequestRecord, request: bytes, stats: ReadStats, t0: float):
        self.record = record
        self.request = request
        self.stats = stats
        self.t0 = t0  # perf_counter() when the request started
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.sse = SSEReader()
        self.status = 0
        self.error_body = b""
        self.now = 0.0
        self.last = 0.0
        self.token_events = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()  # one timestamp for all events of one read
        self.stats.reads += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"bad HTTP response: {exc}")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.done.done():
            return
        if self.status != 200:
            self.error_body += body
            return
        for payload in self.sse.feed(body):
            self.stats.events += 1
            self._on_event(payload)

    def _on_event(self, payload: bytes) -> None:
        record = self.record
        if payload == DONE:
            return
        try:
            chunk = decode_chunk(payload)
        except msgspec.DecodeError as exc:
            self._finish(f"bad event {payload[:100]!r}: {exc}")
            return
        if chunk.error is not None:
            self._finish(f"error event: {str(chunk.error)[:200]}")
            return
        if chunk.usage is not None and chunk.usage.completion_tokens:
            record.output_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            return
        self.token_events += 1
        if self.token_events == 1:
            record.ttft = self.now - self.t0
        else:
            record.itls.append(self.now - self.last)
        self.last = self.now

    def on_message_complete(self) -> None:
        if self.status != 200:
            self._finish(f"HTTP {self.status}: {self.error_body[:200]!r}")
        elif self.token_events == 0:
            self._finish("the stream ended without output")
        else:
            record = self.record
            # As vLLM's client: latency ends at the last output event; a server that sends
            # no usage chunk gets one token per event.
            record.latency = self.last - self.t0
            record.output_tokens = record.output_tokens or self.token_events
            record.ok = True
            self._finish("")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._finish(f"connection lost before the response ended: {exc}")

    def _finish(self, error: str) -> None:
        if self.done.done():
            return
        self.record.error = error
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def stream_request(
    endpoint: Endpoint, request: bytes, record: RequestRecord, stats: ReadStats, t_start: float
) -> RequestRecord:
    """Send one prebuilt request and fill `record`; a failure is recorded, never raised."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    record.start = t0 - t_start
    protocol = _StreamProtocol(record, request, stats, t0)
    try:
        await loop.create_connection(
            lambda: protocol, endpoint.host, endpoint.port, ssl=endpoint.ssl
        )
    except OSError as exc:
        record.error = f"connect: {type(exc).__name__}: {exc}"
        return record
    await protocol.done
    return record
