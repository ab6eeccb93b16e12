"""EagerAcceptor drains the whole accept queue per wakeup (libuv takes one per iteration)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from asyncserve.http.listener import EagerAcceptor, listening_socket

uvloop = pytest.importorskip("uvloop")


def test_one_wakeup_accepts_the_whole_burst() -> None:
    async def main() -> None:
        sock = listening_socket("127.0.0.1", 0, 1024)
        made: list[asyncio.BaseTransport] = []
        received = bytearray()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                made.append(transport)

            def data_received(self, data: bytes) -> None:
                received.extend(data)

        acceptor = EagerAcceptor(sock, Echo, None)
        clients = [socket.create_connection(sock.getsockname()) for _ in range(300)]
        acceptor._on_readable()  # a single readiness callback
        assert len(acceptor._handshakes) == 300  # every queued connection taken at once
        for c in clients:
            c.sendall(b"x")
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(made) == 300 and len(received) == 300:
                break
        assert len(made) == 300 and len(received) == 300
        acceptor.close()
        await acceptor.wait_closed()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(clients[0].getpeername(), timeout=2)
        for t in made:
            t.close()
        for c in clients:
            c.close()

    uvloop.run(main())
