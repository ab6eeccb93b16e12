"""Online serving benchmark: stream completions from a running server with Poisson arrivals.

Options and result fields are named as in vLLM's `vllm bench serve`, so the same command line
and the same JSON keys work against either server. Prompts are random token ids (no tokenizer
needed). The client reads sockets directly (asyncserve/bench/sse_client.py) and can spread
its requests over several processes, and every run prints a self-check of the client's load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import urllib.request
from datetime import datetime
from typing import Any

from asyncserve.bench.client_workers import (
    Job,
    WorkerPlan,
    arrival_times,
    run_plans,
    split_concurrency,
    split_jobs,
)
from asyncserve.bench.serve_metrics import (
    METRICS,
    client_check,
    errors_of,
    print_report,
    summarize,
)
from asyncserve.bench.workload import output_lengths, random_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--random-input-len", "--input-len", type=int, default=512)
    parser.add_argument("--random-output-len", "--output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM's random dataset",
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="for random prompt ids")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="req/s (Poisson); inf = all at once",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the requested output length (default on, unlike vLLM's client)",
    )
    parser.add_argument(
        "--num-client-processes",
        type=int,
        default=1,
        help="split the requests over N client processes (one per free core at high load)",
    )
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument(
        "--save-detailed", action="store_true", help="also save per-request lists in the JSON"
    )
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--output-json", default=None, help="= --save-result --result-filename")


def _first_model(base_url: str, headers: dict[str, str]) -> str:
    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def _lengths(length: int, ratio: float) -> tuple[int, int | None]:
    if ratio <= 0:
        return length, None
    return max(1, math.floor(length * (1 - ratio))), math.ceil(length * (1 + ratio))


def make_jobs(args: argparse.Namespace) -> list[Job]:
    in_low, in_high = _lengths(args.random_input_len, args.random_range_ratio)
    out_low, out_high = _lengths(args.random_output_len, args.random_range_ratio)
    prompts = random_prompts(args.num_prompts, in_low, args.vocab_size, args.seed, in_high)
    outputs = output_lengths(args.num_prompts, out_low, args.seed, out_high)
    times = arrival_times(args.num_prompts, args.request_rate, args.seed)
    return [
        Job(i, t, p, o) for i, (t, p, o) in enumerate(zip(times, prompts, outputs, strict=True))
    ]


def _result_path(args: argparse.Namespace, model: str) -> str | None:
    if args.output_json:
        return str(args.output_json)
    if not args.save_result:
        return None
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.result_filename or (
        f"asyncserve-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{stamp}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def run(args: argparse.Namespace) -> dict[str, Any]:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _first_model(base_url, headers)
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {unknown}; known: {list(METRICS)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]

    jobs = make_jobs(args)
    # More processes than requests (or than concurrency slots) would leave some idle.
    procs = max(1, min(args.num_client_processes, len(jobs), args.max_concurrency or len(jobs)))
    limits = split_concurrency(args.max_concurrency, procs)
    plans = [
        WorkerPlan(base_url, args.endpoint, model, headers, args.ignore_eos, limit, part)
        for part, limit in zip(split_jobs(jobs, procs), limits, strict=True)
    ]
    t0 = time.perf_counter()
    results = run_plans(plans)
    print(f"client: {procs} process(es), {time.perf_counter() - t0:.1f} s including start-up")

    records = [record for _, record in sorted(r for w in results for r in w.records)]
    duration = max(w.wall_s for w in results)
    result = summarize(records, duration, metrics, percentiles)
    result.update(
        {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai",
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "num_prompts": args.num_prompts,
            # As vLLM writes it: JSON has no infinity.
            "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
            "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
        }
    )
    result.update(client_check(results))
    print_report(result, metrics, percentiles)
    errors = errors_of(records)
    if errors:
        print("first errors:", errors[:3])
    if args.save_detailed:
        result.update(
            {
                "input_lens": [r.prompt_len for r in records],
                "output_lens": [r.output_tokens for r in records],
                "ttfts": [r.ttft for r in records],
                "itls": [r.itls for r in records],
                "latencies": [r.latency for r in records],
                "start_times": [r.start for r in records],
                "errors": [r.error for r in records],
            }
        )
    path = _result_path(args, model)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {path}")
    return result
