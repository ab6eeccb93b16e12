"""Online serving benchmark: stream completions from a running server with Poisson arrivals.

Reports what vLLM's `bench serve` reports: request and token throughput, TTFT, TPOT, ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from asyncserve.bench.workload import Summary, random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=32000, help="for random prompt ids")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="req/s (Poisson); inf = all at once",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--output-json", default=None)


@dataclass
class RequestRecord:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str]
) -> RequestRecord:
    record = RequestRecord()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if record.ttft == 0.0:
                    record.ttft = now - start
                else:
                    record.itls.append(now - last)
                last = now
        record.latency = time.perf_counter() - start
        record.ok = True
    except Exception as exc:  # a failed request is counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            models = (await client.get("/v1/models", headers=headers)).json()
            model = models["data"][0]["id"]
        prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
        rng = random.Random(args.seed)
        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            payload = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.output_len,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(_one(client, "/v1/completions", payload, headers)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = Summary.of([r.ttft for r in ok])
    tpot = Summary.of(
        [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    )
    itl = Summary.of([x for r in ok for x in r.itls])
    report = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + len(ok) * args.input_len) / duration,
        "ttft_s": vars(ttft),
        "tpot_s": vars(tpot),
        "itl_s": vars(itl),
        "request_rate": args.request_rate,
    }
    print(f"completed {len(ok)}, failed {report['failed']}, {duration:.2f} s")
    print(
        f"request throughput {report['request_throughput']:.2f} req/s, "
        f"output {report['output_token_throughput']:.0f} tok/s"
    )
    print(f"TTFT {ttft.ms()}\nTPOT {tpot.ms()}\nITL  {itl.ms()}")
    errors = [r.error for r in records if not r.ok][:3]
    if errors:
        print("first errors:", errors)
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    report = asyncio.run(_run(args))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report
