"""`bench serve` results under vLLM's `bench serve` field names, and the printed report.

Percentiles are numpy's (linear interpolation), as vLLM computes them, so the two clients'
figures on the same records agree. A metric with no values reads 0, as in vLLM.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from asyncserve.bench.client_workers import WorkerResult
from asyncserve.bench.sse_client import RequestRecord

METRICS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}

# A client process at this share of one core may be what limits the run.
CPU_WARN_PCT = 90.0
# More SSE events per socket read than this means events waited to be read (or the server
# batched its writes): ITLs inside one read are ~0 and say nothing about the server.
BURST_WARN_EVENTS_PER_READ = 1.5


def percentile_name(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's key names)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def metric_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Seconds per metric over the completed requests (TPOT needs two tokens or more)."""
    ok = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.latency for r in ok],
    }


def summarize(
    records: list[RequestRecord],
    duration: float,
    percentile_metrics: list[str],
    percentiles: list[float],
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    values = metric_values(records)
    for name in percentile_metrics:
        ms = np.asarray(values[name] or [0.0]) * 1000
        result[f"mean_{name}_ms"] = float(np.mean(ms))
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(np.std(ms))
        for p in percentiles:
            result[f"{percentile_name(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return result


def client_check(results: list[WorkerResult]) -> dict[str, Any]:
    """How busy the client was: CPU % of one core per process, SSE events per socket read."""
    reads = sum(w.stats.reads for w in results)
    events = sum(w.stats.events for w in results)
    return {
        "num_client_processes": len(results),
        "client_cpu_percent": [round(100 * w.cpu_s / w.wall_s, 1) for w in results],
        "client_events_per_read": events / reads if reads else 0.0,
    }


def print_report(
    result: dict[str, Any], percentile_metrics: list[str], percentiles: list[float]
) -> None:
    row = "{:<40} {:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(row.format("Successful requests:", result["completed"]))
    print(row.format("Failed requests:", result["failed"]))
    if result.get("max_concurrency") is not None:
        print(row.format("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate", "inf") != "inf":
        print(row.format("Request rate configured (RPS):", f"{result['request_rate']:.2f}"))
    print(row.format("Benchmark duration (s):", f"{result['duration']:.2f}"))
    print(row.format("Total input tokens:", result["total_input_tokens"]))
    print(row.format("Total generated tokens:", result["total_output_tokens"]))
    print(row.format("Request throughput (req/s):", f"{result['request_throughput']:.2f}"))
    print(row.format("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    print(row.format("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"))
    for name in percentile_metrics:
        label = name.upper()
        print("{s:{c}^{n}}".format(s=METRICS[name], n=50, c="-"))
        print(row.format(f"Mean {label} (ms):", f"{result[f'mean_{name}_ms']:.2f}"))
        print(row.format(f"Median {label} (ms):", f"{result[f'median_{name}_ms']:.2f}"))
        for p in percentiles:
            key = percentile_name(p)
            print(row.format(f"P{key[1:]} {label} (ms):", f"{result[f'{key}_{name}_ms']:.2f}"))
    print("{s:{c}^{n}}".format(s="Client self-check", n=50, c="-"))
    cpu = result["client_cpu_percent"]
    print(row.format("Client processes:", result["num_client_processes"]))
    print(row.format("Client CPU (% of a core, per process):", ", ".join(f"{c:.0f}" for c in cpu)))
    print(row.format("SSE events per socket read:", f"{result['client_events_per_read']:.2f}"))
    print("=" * 50)
    for warning in client_warnings(result):
        print(f"WARNING: {warning}")


def client_warnings(result: dict[str, Any]) -> list[str]:
    warnings = []
    busiest = max(result["client_cpu_percent"], default=0.0)
    if busiest >= CPU_WARN_PCT:
        warnings.append(
            f"a client process used {busiest:.0f}% of a core: the client may be what limits "
            "this run; use more --num-client-processes (one per free core)"
        )
    if result["client_events_per_read"] > BURST_WARN_EVENTS_PER_READ:
        warnings.append(
            f"{result['client_events_per_read']:.1f} SSE events per socket read: events arrive "
            "in bursts (a busy client, or a server that batches writes), so ITLs within a "
            "burst are ~0"
        )
    return warnings


def errors_of(records: list[RequestRecord], limit: int = 10) -> list[str]:
    return [r.error for r in records if not r.ok][:limit]
