"""W7 (benchmarks: /work/shared/bench/WORKLOADS.md): the HTTP layer on the CPU.

One server process (uvicorn + uvloop + httptools, the real asyncserve app) around the W7 stub
engine, which emits a token every 20 ms per request; 500 concurrent SSE chat streams of 100
tokens. Prints streamed tokens/s, the p50/p99/max gap between a stream's events, and the
server's CPU use.

    python benchmarks/w7_http.py [--streams 500] [--tokens 100] [--tick-ms 20]

The client is a raw asyncio protocol (it counts events, it does not parse JSON) in this
process, so it costs the server as little CPU as possible; both share the machine.

The stub bounds the rate at streams / tick (25,000 tokens/s for 500 streams at 20 ms): to
see more than that from the server, shorten the tick (`--tick-ms 10`: 50,000). The server's
CPU time per streamed token does not depend on other load on the machine the way the rate
does; 1e6 over it is what one fully used core would carry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKEN_MARK = b'"delta":{"content":'
DONE_MARK = b"data: [DONE]"


def serve(port: int, tick_s: float) -> None:
    from asyncserve.config import ServerConfig
    from asyncserve.http.server import run_server
    from benchmarks.w7_stub_engine import StubEngine

    config = ServerConfig(
        port=port,
        served_model_names=("w7-stub",),
        disable_access_log=True,
        log_level="warning",
        shutdown_timeout=1,
    )
    sys.exit(run_server(StubEngine(tick_s=tick_s), config))


@dataclass
class Stream:
    """One SSE stream, read with a bare protocol: token events and their arrival times."""

    request: bytes
    done: asyncio.Future[None]
    times: list[float] = field(default_factory=list)
    tail: bytes = b""
    status_ok: bool | None = None


class StreamProtocol(asyncio.Protocol):
    def __init__(self, stream: Stream) -> None:
        self.s = stream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.s.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        s = self.s
        if s.status_ok is None:
            s.status_ok = data.startswith(b"HTTP/1.1 200")
        text = s.tail + data
        # A mark split across reads is counted once: keep the last bytes that could start one.
        count = text.count(TOKEN_MARK)
        s.times.extend([now] * count)
        if DONE_MARK in text and not s.done.done():
            s.done.set_result(None)
        keep = max(len(TOKEN_MARK), len(DONE_MARK)) - 1
        cut = text.rfind(TOKEN_MARK)
        start = max(len(text) - keep, cut + len(TOKEN_MARK) if cut >= 0 else 0)
        s.tail = text[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.s.done.done():
            self.s.done.set_exception(ConnectionError(f"connection lost: {exc}"))


def request_bytes(port: int, tokens: int, index: int) -> bytes:
    body = json.dumps(
        {
            "model": "w7-stub",
            "messages": [{"role": "user", "content": f"Tell me story number {index}."}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(port: int, streams: int, tokens: int, server_pid: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    states = [Stream(request_bytes(port, tokens, i), loop.create_future()) for i in range(streams)]
    cpu0, client0, t0 = cpu_seconds(server_pid), time.process_time(), time.perf_counter()
    transports = []
    for state in states:
        transport, _ = await loop.create_connection(
            lambda st=state: StreamProtocol(st), "127.0.0.1", port
        )
        transports.append(transport)
    results = await asyncio.gather(*(s.done for s in states), return_exceptions=True)
    t1, cpu1, client1 = time.perf_counter(), cpu_seconds(server_pid), time.process_time()
    for transport in transports:
        transport.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    bad_status = sum(1 for s in states if not s.status_ok)
    short = sum(1 for s in states if len(s.times) != tokens)
    gaps = [b - a for s in states for a, b in zip(s.times, s.times[1:], strict=False)]
    total = sum(len(s.times) for s in states)
    wall = t1 - t0
    first = [s.times[0] - t0 for s in states if s.times]
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "failed_streams": len(failed) + bad_status,
        "short_streams": short,
        "wall_s": wall,
        "streamed_tokens": total,
        "tokens_per_s": total / wall,
        "gap_p50_ms": statistics.median(gaps) * 1000,
        "gap_p99_ms": percentile(gaps, 0.99) * 1000,
        "gap_max_ms": max(gaps) * 1000,
        "first_token_p99_ms": percentile(first, 0.99) * 1000,
        "server_cpu_pct": 100 * (cpu1 - cpu0) / wall,
        # What one event costs the server: robust to other load on the machine (the rate is not).
        "server_cpu_us_per_token": 1e6 * (cpu1 - cpu0) / max(1, total),
        "client_cpu_pct": 100 * (client1 - client0) / wall,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--tick-ms", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3, help="runs against one server")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print each run as JSON")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin the server to CPU 0 and this client to CPU 1 (Linux)",
    )
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.tick_ms / 1000)
        return
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--tick-ms", str(args.tick_ms)]
    )
    if args.pin:
        os.sched_setaffinity(proc.pid, {0})
        os.sched_setaffinity(0, {1})
    try:
        wait_ready(port, proc)
        import uvloop

        for run in range(args.repeat):
            report = uvloop.run(drive(port, args.streams, args.tokens, proc.pid))
            if args.json:
                print(json.dumps(report))
                continue
            print(
                f"run {run + 1}: {report['streams']} streams x {report['tokens_per_stream']} "
                f"tokens, {report['failed_streams']} failed, {report['short_streams']} short; "
                f"{report['tokens_per_s']:.0f} streamed tok/s over {report['wall_s']:.2f} s; "
                f"gap p50 {report['gap_p50_ms']:.1f} ms, p99 {report['gap_p99_ms']:.1f} ms, "
                f"max {report['gap_max_ms']:.1f} ms; first token p99 "
                f"{report['first_token_p99_ms']:.0f} ms; server CPU "
                f"{report['server_cpu_pct']:.0f}% ({report['server_cpu_us_per_token']:.1f} us per "
                f"token), client CPU {report['client_cpu_pct']:.0f}%"
            )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
