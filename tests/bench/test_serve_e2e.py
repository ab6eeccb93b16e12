"""`python -m asyncserve bench serve` against a real HTTP server: the asyncserve app around the
W7 stub engine (benchmarks/w7_stub_engine.py, one token per request every 2 ms)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncserve.bench import serve
from benchmarks.w7_http import free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stub_server() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "benchmarks/w7_http.py", "--serve", str(port), "--tick-ms", "2"],
        cwd=REPO,
    )
    try:
        wait_ready(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.timeout(60)
def test_two_client_processes_and_saved_result(stub_server: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "asyncserve", "bench", "serve",
        "--base-url", stub_server,
        "--dataset-name", "random",
        "--num-prompts", "40",
        "--random-input-len", "20",
        "--random-output-len", "12",
        "--random-range-ratio", "0.5",
        "--vocab-size", "250",
        "--request-rate", "200",
        "--num-client-processes", "2",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path),
        "--result-filename", "result.json",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Client self-check" in out.stdout and "SSE events per socket read" in out.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 40 and result["failed"] == 0
    assert result["num_client_processes"] == 2 and len(result["client_cpu_percent"]) == 2
    # lengths drawn in [len/2, len*3/2]; the server generates exactly the requested length
    assert all(10 <= n <= 30 for n in result["input_lens"])
    assert all(6 <= n <= 18 for n in result["output_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert len(result["itls"]) == 40
    assert all(
        len(itl) == n - 1 for itl, n in zip(result["itls"], result["output_lens"], strict=True)
    )
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in result
    assert 1.0 <= result["median_itl_ms"] < 50.0  # a token every 2 ms, on a shared CPU
    assert result["client_events_per_read"] > 0


def _args(base_url: str, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", base_url, "--vocab-size", "250"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.timeout(60)
def test_old_flag_names_and_output_json(stub_server: str, tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url", stub_server, "--num-prompts", "8", "--input-len", "5",
            "--output-len", "4", "--vocab-size", "250", "--output-json", str(path),
        ]
    )  # fmt: skip
    result = serve.run(args)
    assert result["completed"] == 8 and result["total_output_tokens"] == 32
    assert result["total_input_tokens"] == 40
    assert json.loads(path.read_text())["completed"] == 8


@pytest.mark.timeout(60)
def test_rejected_requests_are_counted_as_failed(stub_server: str) -> None:
    # The stub's context is 4096 tokens: a 5000-token output is refused with HTTP 400.
    result = serve.run(_args(stub_server, num_prompts=3, random_output_len=5000))
    assert result["completed"] == 0 and result["failed"] == 3


@pytest.mark.timeout(60)
def test_max_concurrency_holds(stub_server: str) -> None:
    args = _args(
        stub_server, num_prompts=12, random_output_len=10, max_concurrency=3, save_detailed=True
    )
    result = serve.run(args)
    assert result["completed"] == 12
    spans = sorted(
        (s, s + t) for s, t in zip(result["start_times"], result["latencies"], strict=True)
    )
    # at no request's start are more than 3 requests open (itself included)
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 3
