"""KV transfer time of disaggregated prefill, per connector, on a 2-GPU host.

For each connector, starts a producer on one GPU and a consumer on the other (dummy weights),
then for each of --num-requests distinct prompts of --input-len tokens: prefills on the
producer (max_tokens 1, do_remote_decode), then times the consumer's request (max_tokens 1)
that pulls the prompt's blocks and computes the last partial block. The consumer's own
compute of one block is small, so that time is mostly the transfer. Reports the median and
p90, the payload's GB/s and how often the consumer's greedy first token equals the
producer's (a check that the blocks arrived whole), in $OUT/disagg_<connector>.json and $OUT/disagg.json.

    python benchmarks/disagg_bench.py --out $OUT                       # TCPConnector and PyNcclConnector
    python benchmarks/disagg_bench.py --connector PyNcclConnector --input-len 4096 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(args: argparse.Namespace, gpu: int, config: dict[str, object], log: Path) -> tuple[subprocess.Popen[bytes], str]:  # fmt: skip
    port = free_port()
    cmd = [sys.executable, "-m", "asyncserve", "serve", "--port", str(port), "--model",
           args.model, "--load-format", args.load_format, "--max-model-len",
           str(args.input_len + 64), "--kv-transfer-config", json.dumps(config)]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen[bytes], base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {base} exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server {base} not ready after {timeout} s")


def complete(base: str, prompt: list[int], **extra: object) -> dict[str, object]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    answer: dict[str, object] = reply.json()
    return answer


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    config = json.loads((Path(model) / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return int(config["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes)


def run(args: argparse.Namespace, connector: str, out: Path) -> dict[str, object]:
    group_port = free_port()

    def config(role: str, rank: int) -> dict[str, object]:
        kv: dict[str, object] = {"kv_connector": connector, "kv_role": role}
        if connector != "TCPConnector":
            kv.update(kv_rank=rank, kv_parallel_size=2, kv_ip="127.0.0.1", kv_port=group_port)
        return kv

    consumer, c_base = start(args, 1, config("kv_consumer", 0), out / f"{connector}_consumer.log")
    producer, p_base = start(args, 0, config("kv_producer", 1), out / f"{connector}_producer.log")
    try:
        wait_ready(producer, p_base)
        wait_ready(consumer, c_base)
        rng = random.Random(0)
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        times: list[float] = []
        agree = 0  # the consumer's greedy first token equals the producer's
        for i in range(args.warmup + args.num_requests):
            prompt = [rng.randrange(vocab // 10, vocab) for _ in range(args.input_len)]
            prefilled = complete(p_base, prompt, kv_transfer_params={"do_remote_decode": True})
            params = {**prefilled["kv_transfer_params"], "remote_url": p_base}  # type: ignore[dict-item]
            start_s = time.perf_counter()
            decoded = complete(c_base, prompt, kv_transfer_params=params)
            elapsed = time.perf_counter() - start_s
            choice = decoded["choices"][0]  # type: ignore[index]
            if choice["finish_reason"] == "error":
                raise RuntimeError(f"transfer failed; see {out}/{connector}_consumer.log")
            if i >= args.warmup:
                times.append(elapsed)
                agree += choice["text"] == prefilled["choices"][0]["text"]  # type: ignore[index]
    finally:
        for proc in (consumer, producer):
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    times.sort()
    payload = kv_bytes_per_token(args.model) * args.input_len
    median = statistics.median(times)
    result: dict[str, object] = {
        "connector": connector,
        "input_len": args.input_len,
        "requests": len(times),
        "pull_request_median_ms": median * 1e3,
        "pull_request_p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
        "payload_mb": payload / 1e6,
        "payload_gb_per_s_at_median": payload / median / 1e9,
        "first_token_agreement": agree / len(times),
    }
    (out / f"disagg_{connector}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "benchmarks/configs/llama3-8b"))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--connector", nargs="+", default=["TCPConnector", "PyNcclConnector"])
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--num-requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run(args, connector, args.out) for connector in args.connector]
    (args.out / "disagg.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
