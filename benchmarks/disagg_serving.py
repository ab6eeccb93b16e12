"""Disaggregated prefill against two colocated replicas, serving long prompts on a 2-GPU host.

Runs the same client (`asyncserve bench serve`: the same random prompt ids, Poisson arrivals at
--request-rate, EOS ignored, streamed) against
  disagg  a kv_producer on GPU 0 and a kv_consumer on GPU 1 (--connector) behind
          `asyncserve proxy`, so GPU 1 only decodes;
  dp2     one server with --data-parallel-size 2 (a replica per GPU, each prefilling and decoding);
and writes $OUT/disagg_serving.json with each run's TTFT / TPOT / ITL (median, p99) and
throughput, and the ITL p99 ratio (the goal: dp2 / disagg >= 2 at equal or better throughput).

    python benchmarks/disagg_serving.py --out $OUT
    python benchmarks/disagg_serving.py --input-len 4096 --output-len 256 --request-rate 5 \
        --num-prompts 200 --connector PyNcclConnector --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from disagg_bench import REPO, free_port, wait_ready  # noqa: E402


def serve(args: argparse.Namespace, gpus: str, extra: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "asyncserve", "serve", "--port", str(port), "--model",
           args.model, "--load-format", args.load_format, "--max-model-len",
           str(args.input_len + args.output_len + 64), *extra]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench(args: argparse.Namespace, base: str, name: str) -> dict[str, Any]:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    result = args.out / f"serve_{name}.json"
    cmd = [sys.executable, "-m", "asyncserve", "bench", "serve", "--base-url", base,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           "--vocab-size", str(vocab), "--metric-percentiles", "50,90,99",
           "--num-client-processes", "2", "--output-json", str(result)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True, timeout=args.bench_timeout)
    report: dict[str, Any] = json.loads(result.read_text())
    return report


def run_disagg(args: argparse.Namespace) -> dict[str, Any]:
    group_port = free_port()

    def kv(role: str, rank: int) -> list[str]:
        config: dict[str, object] = {"kv_connector": args.connector, "kv_role": role}
        if args.connector != "TCPConnector":
            config.update(kv_rank=rank, kv_parallel_size=2, kv_ip="127.0.0.1", kv_port=group_port)
        return ["--kv-transfer-config", json.dumps(config)]

    consumer, c_base = serve(args, "1", kv("kv_consumer", 0), args.out / "disagg_consumer.log")
    producer, p_base = serve(args, "0", kv("kv_producer", 1), args.out / "disagg_producer.log")
    procs = [consumer, producer]
    try:
        wait_ready(producer, p_base)
        wait_ready(consumer, c_base)
        port = free_port()
        proxy_cmd = [sys.executable, "-m", "asyncserve", "proxy", "--port", str(port),
                     "--prefill", p_base, "--decode", c_base]  # fmt: skip
        with open(args.out / "disagg_proxy.log", "wb") as out:
            proxy = subprocess.Popen(proxy_cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proxy)
        wait_ready(proxy, f"http://127.0.0.1:{port}", timeout=60)
        report = bench(args, f"http://127.0.0.1:{port}", "disagg")
        # What each instance computed and moved (prefix hits, pulled blocks): where the
        # decode instance's slow gaps come from.
        for name, base in (("consumer", c_base), ("producer", p_base)):
            with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
                (args.out / f"disagg_{name}_metrics.txt").write_bytes(reply.read())
        return report
    finally:
        stop(procs)


def run_dp2(args: argparse.Namespace) -> dict[str, Any]:
    server, base = serve(args, "0,1", ["--data-parallel-size", "2"], args.out / "dp2_server.log")
    try:
        wait_ready(server, base)
        return bench(args, base, "dp2")
    finally:
        stop([server])


def summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "failed", "request_throughput", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "median_itl_ms", "p90_itl_ms", "p99_itl_ms")  # fmt: skip
    return {key: report.get(key) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "benchmarks/configs/llama3-8b"))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--connector", default="PyNcclConnector")
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=5.0)
    parser.add_argument("--bench-timeout", type=float, default=400)
    parser.add_argument("--only", choices=["disagg", "dp2"], default=None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    for name, run in (("disagg", run_disagg), ("dp2", run_dp2)):
        if args.only in (None, name):
            try:
                runs[name] = summary(run(args))
            except Exception as error:  # one failed configuration still reports the other
                runs[name] = {"error": repr(error)}
            print(name, json.dumps(runs[name]), flush=True)
    report: dict[str, Any] = {"workload": vars(args) | {"out": str(args.out)}, "runs": runs}
    disagg, dp2 = runs.get("disagg", {}), runs.get("dp2", {})
    if disagg.get("p99_itl_ms") and dp2.get("p99_itl_ms"):
        report["itl_p99_dp2_over_disagg"] = dp2["p99_itl_ms"] / disagg["p99_itl_ms"]
        report["output_throughput_disagg_over_dp2"] = (
            disagg["output_throughput"] / dp2["output_throughput"]
        )
    (args.out / "disagg_serving.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "workload"}, indent=2))


if __name__ == "__main__":
    main()
