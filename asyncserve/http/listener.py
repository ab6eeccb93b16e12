"""A listening socket that accepts every pending connection at once.

libuv (under uvloop) accepts one connection per event-loop iteration since libuv 1.45
(libuv PR 3696). While hundreds of streams keep the loop busy, an iteration takes tens of
milliseconds, so a burst of N new connections is admitted over N iterations: measured with
500 streams at once (benchmarks/w7_http.py), the last connection waited 3-7 s to be accepted.
Here the loop is told when the socket is readable and drains the accept queue itself, then
hands each socket to uvloop (connect_accepted_socket) with uvicorn's protocol.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

logger = logging.getLogger("uvicorn.error")
MAX_ACCEPTS_PER_WAKEUP = 1024


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (IPv4 or IPv6, from the host), not listening yet.

    Bound before the model loads, so a port in use is reported at once; connections are
    refused (not queued) until listen()."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listening_socket(
    host: str, port: int, backlog: int, sock: socket.socket | None = None
) -> socket.socket:
    """A non-blocking socket listening on host:port; `sock`, when given, is already bound."""
    sock = sock or bound_socket(host, port)
    try:
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class EagerAcceptor:
    """Accepts up to MAX_ACCEPTS_PER_WAKEUP connections each time the socket is readable.

    Quacks like the asyncio Server uvicorn keeps in `Server.servers` (close, wait_closed).
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.sock = sock
        self.protocol_factory = protocol_factory
        self.ssl_context = ssl_context
        self.loop = asyncio.get_running_loop()
        self._handshakes: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        for _ in range(MAX_ACCEPTS_PER_WAKEUP):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:  # out of file descriptors and the like: try again later
                logger.error("accept failed: %s", exc)
                return
            conn.setblocking(False)
            task = self.loop.create_task(self._connect(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(
                self.protocol_factory, conn, ssl=self.ssl_context
            )
        except (OSError, ssl.SSLError) as exc:  # a client that left, or a failed handshake
            logger.debug("connection setup failed: %s", exc)
            conn.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    async def wait_closed(self) -> None:
        for task in list(self._handshakes):
            task.cancel()
        await asyncio.gather(*self._handshakes, return_exceptions=True)


class EagerAcceptServer(uvicorn.Server):
    """uvicorn's Server with the listening socket served by an EagerAcceptor."""

    # Bound by the caller before the model loaded (see bound_socket); else bound here.
    bound: socket.socket | None = None
    # Called when shutdown begins (SIGTERM), to start the --shutdown-timeout clock.
    on_shutdown: Callable[[], None] | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is not None or self.config.uds is not None or self.config.fd is not None:
            await super().startup(sockets)
            return
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            sys.exit(3)
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            protocol: asyncio.Protocol = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )
            return protocol

        try:
            sock = listening_socket(config.host, config.port, config.backlog, self.bound)
        except OSError as exc:
            logger.error(exc)
            await self.lifespan.shutdown()
            sys.exit(1)
        self.servers = [EagerAcceptor(sock, create_protocol, config.ssl)]  # type: ignore[list-item]
        self._log_started_message([sock])
        self.started = True


def timed_protocol(header_timeout_s: float | None) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol that answers 408 and closes a connection whose request
    headers do not all arrive within `header_timeout_s` (a slow or silent client would
    otherwise hold the connection forever); "h11" when httptools is missing."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if header_timeout_s is not None and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()  # a later request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a response is still being sent: its request was read in time
            body = b'{"error":{"message":"request headers not received in time","code":408}}'
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            self.transport.close()

    return HeaderTimeoutProtocol
