"""Summary math and vLLM result names of `bench serve` (asyncserve/bench/serve_metrics.py)."""

from __future__ import annotations

import pytest

from asyncserve.bench.client_workers import WorkerResult
from asyncserve.bench.serve_metrics import (
    client_check,
    client_warnings,
    percentile_name,
    summarize,
)
from asyncserve.bench.sse_client import ReadStats, RequestRecord


def _record(ttft: float, itls: list[float], prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(
        prompt_len=prompt_len,
        ok=True,
        ttft=ttft,
        latency=ttft + sum(itls),
        itls=itls,
        output_tokens=len(itls) + 1,
    )


def test_percentile_names() -> None:
    assert percentile_name(99) == "p99"
    assert percentile_name(50.0) == "p50"
    assert percentile_name(99.9) == "p99.9"


def test_summary_counts_throughput_and_latencies() -> None:
    records = [
        _record(0.1, [0.01, 0.03]),  # 3 tokens, latency 0.14, TPOT 0.02
        _record(0.3, [0.02]),  # 2 tokens, latency 0.32, TPOT 0.02
        RequestRecord(prompt_len=10, error="HTTP 500"),
    ]
    result = summarize(
        records,
        duration=2.0,
        percentile_metrics=["ttft", "tpot", "itl", "e2el"],
        percentiles=[50, 99],
    )
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_input_tokens"] == 20  # failed requests do not count
    assert result["total_output_tokens"] == 5
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(2.5)
    assert result["total_token_throughput"] == pytest.approx(12.5)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["std_ttft_ms"] == pytest.approx(100.0)
    # numpy's linear interpolation between 100 and 300 ms
    assert result["p99_ttft_ms"] == pytest.approx(298.0)
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["mean_tpot_ms"] == pytest.approx(20.0)
    assert result["mean_itl_ms"] == pytest.approx(20.0)  # 10, 30, 20 ms
    assert result["median_itl_ms"] == pytest.approx(20.0)
    assert result["p99_itl_ms"] == pytest.approx(29.8)
    assert result["mean_e2el_ms"] == pytest.approx(230.0)


def test_percentiles_match_the_definition() -> None:
    records = [_record(t / 1000, [0.001]) for t in range(1, 101)]  # TTFT 1..100 ms
    result = summarize(records, 1.0, ["ttft"], [50, 90, 99, 99.9])
    assert result["p50_ttft_ms"] == pytest.approx(50.5)
    assert result["p90_ttft_ms"] == pytest.approx(90.1)
    assert result["p99_ttft_ms"] == pytest.approx(99.01)
    assert result["p99.9_ttft_ms"] == pytest.approx(99.901)
    assert "mean_itl_ms" not in result  # only the metrics asked for


def test_tpot_skips_single_token_requests_and_empty_reads_zero() -> None:
    result = summarize([_record(0.05, [])], 1.0, ["tpot", "itl"], [99])
    assert result["completed"] == 1 and result["total_output_tokens"] == 1
    assert result["mean_tpot_ms"] == 0.0 and result["p99_itl_ms"] == 0.0


def test_client_check_and_warnings() -> None:
    results = [
        WorkerResult([], ReadStats(reads=100, events=300), cpu_s=0.95, wall_s=1.0),
        WorkerResult([], ReadStats(reads=100, events=100), cpu_s=0.2, wall_s=1.0),
    ]
    check = client_check(results)
    assert check["num_client_processes"] == 2
    assert check["client_cpu_percent"] == [95.0, 20.0]
    assert check["client_events_per_read"] == pytest.approx(2.0)
    warnings = client_warnings(check)
    assert len(warnings) == 2 and "95%" in warnings[0] and "bursts" in warnings[1]
    calm = client_check([WorkerResult([], ReadStats(reads=10, events=10), 0.1, 1.0)])
    assert client_warnings(calm) == []
