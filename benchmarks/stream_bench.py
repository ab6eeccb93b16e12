"""Streamed tokens/s through the HTTP server with a real model, at several concurrencies.

Starts `python -m asyncserve serve` (the default SmolLM2 model unless --model), then for each
concurrency C runs C streaming completions at once, each exactly --tokens tokens (ignore_eos),
and reports streamed tokens/s (all streams), per-stream tokens/s and time to first token.

    python benchmarks/stream_bench.py [--concurrency 1 16 64] [--tokens 64]
    python benchmarks/stream_bench.py --base-url http://127.0.0.1:8000   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@dataclass
class StreamResult:
    ttft: float
    duration: float
    tokens: int


async def one_stream(client: httpx.AsyncClient, tokens: int) -> StreamResult:
    body = {
        "prompt": PROMPT,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = 0.0
    count = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            elif ttft == 0.0 and chunk["choices"] and chunk["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    return StreamResult(ttft, time.perf_counter() - start, count)


async def run_level(base_url: str, concurrency: int, tokens: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, tokens) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    total = sum(r.tokens for r in results)
    per_stream = [r.tokens / r.duration for r in results]
    return {
        "concurrency": concurrency,
        "tokens": total,
        "wall_s": wall,
        "streamed_tok_s": total / wall,
        "per_stream_tok_s_median": statistics.median(per_stream),
        "ttft_median_ms": statistics.median(r.ttft for r in results) * 1000,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "asyncserve", "serve", "--port", str(port),
        "--max-model-len", "2048", "--kv-cache-memory", args.kv_cache_memory,
        "--max-num-seqs", str(max(args.concurrency)),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.serve_arg
    proc = subprocess.Popen(cmd, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--base-url", default=None, help="use a running server")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", default="512M")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more flag for the server, e.g. --serve-arg=--no-async-scheduling",
    )
    args = parser.parse_args()
    proc = None
    base = args.base_url
    if base is None:
        proc, base = start_server(args)
    try:
        asyncio.run(run_level(base, 1, 8))  # warm-up
        for concurrency in args.concurrency:
            report = asyncio.run(run_level(base, concurrency, args.tokens))
            if args.json:
                print(json.dumps(report))
                continue
            print(
                f"{concurrency:3d} streams x {args.tokens} tokens: "
                f"{report['streamed_tok_s']:7.1f} streamed tok/s, "
                f"{report['per_stream_tok_s_median']:6.1f} tok/s per stream (median), "
                f"TTFT median {report['ttft_median_ms']:.0f} ms, wall {report['wall_s']:.1f} s"
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
