"""An independent streaming client for checking `bench serve`: aiohttp, no shared code.

Sends N completions with random token-id prompts at once (or at most --max-concurrency),
streams each to its end and reports output tok/s from the servers' usage chunks. Used beside
`python -m asyncserve bench serve` on the same server: if both agree, neither client is the
bound.

  python benchmarks/raw_stream_client.py --base-url http://127.0.0.1:8000 --num-prompts 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    tokens = 0
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    low = min(1000, args.vocab_size // 4)  # clear of the special ids at the bottom
    bodies = [
        {
            "model": args.model,
            "prompt": [rng.randrange(low, args.vocab_size) for _ in range(args.input_len)],
            "max_tokens": args.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for _ in range(args.num_prompts)
    ]
    url = args.base_url + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(one(session, url, b) for b in bodies),
                                       return_exceptions=True)  # fmt: skip
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    ok = [r for r in results if isinstance(r, int)]
    print(json.dumps({
        "client": "raw_aiohttp",
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": round(elapsed, 3),
        "output_throughput": round(sum(ok) / elapsed, 1),
        "client_cpu_percent": round(100 * cpu / elapsed, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
