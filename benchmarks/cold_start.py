"""W5: seconds from process start to the first token served over HTTP."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("extra", nargs="*", help="more serve flags")
    args = parser.parse_args()
    start = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncserve",
            "serve",
            "--model",
            args.model,
            "--load-format",
            "dummy",
            "--port",
            str(args.port),
            *args.extra,
        ],
    )
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    body = {"prompt": [1000, 2000, 3000], "max_tokens": 1, "model": None}
    ready_at: float | None = None
    try:
        while time.perf_counter() - start < args.timeout:
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode}")
            try:
                models = httpx.get(f"http://127.0.0.1:{args.port}/v1/models", timeout=2).json()
                if ready_at is None:
                    ready_at = time.perf_counter() - start
                    print(f"server answering after {ready_at:.2f} s")
                body["model"] = models["data"][0]["id"]
                response = httpx.post(url, json=body, timeout=60)
                if response.status_code == 200:
                    print(f"cold start to first token: {time.perf_counter() - start:.2f} s")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise SystemExit("no token within the timeout")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
