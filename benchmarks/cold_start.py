"""W5: seconds from process start to the first token served over HTTP.

Also reports when the model loader logs its first line ("loading ... onto ..."): the time
before it is Python imports and set-up, the CPU-side part of the cold start. Each line of the
server's log is passed through after its seconds since the start, which times every phase. On a CPU
machine: `python benchmarks/cold_start.py --model benchmarks/configs/llama-tiny --repeat 3`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import httpx

LOADER_LINE = " onto "  # models/loader.py: "loading <source> (<kind>) onto <device>"


def _watch_log(server: subprocess.Popen[str], start: float, seen: dict[str, float]) -> None:
    # Passes the server's log through, each line after its seconds since the start (the
    # phases of a start), and notes when the loader's first line appears.
    assert server.stderr is not None
    for line in server.stderr:
        elapsed = time.perf_counter() - start
        if "loader" not in seen and "loading " in line and LOADER_LINE in line:
            seen["loader"] = elapsed
        sys.stderr.write(f"[{elapsed:6.2f}] {line}")


def cold_start(model: str, port: int, timeout: float, extra: list[str]) -> dict[str, float]:
    """One start: seconds to the loader line, to the first answer, to the first token."""
    seen: dict[str, float] = {}
    start = time.perf_counter()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncserve",
            "serve",
            "--model",
            model,
            "--load-format",
            "dummy",
            "--port",
            str(port),
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = threading.Thread(target=_watch_log, args=(server, start, seen), daemon=True)
    watcher.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": [100, 200, 300], "max_tokens": 1, "model": None}
    try:
        while time.perf_counter() - start < timeout:
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode}")
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).json()
                if "ready" not in seen:
                    seen["ready"] = time.perf_counter() - start
                    print(f"server answering after {seen['ready']:.2f} s")
                body["model"] = models["data"][0]["id"]
                response = httpx.post(url, json=body, timeout=60)
                if response.status_code == 200:
                    seen["token"] = time.perf_counter() - start
                    if "loader" in seen:
                        print(f"loader's first line after {seen['loader']:.2f} s")
                    print(f"cold start to first token: {seen['token']:.2f} s")
                    return seen
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise SystemExit("no token within the timeout")
    finally:
        server.terminate()
        server.wait(30)
        watcher.join(5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="benchmarks/configs/llama3-8b")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--repeat", type=int, default=1, help="starts, one after another")
    parser.add_argument("extra", nargs="*", help="more serve flags")
    args = parser.parse_args()
    runs = [cold_start(args.model, args.port, args.timeout, args.extra) for _ in range(args.repeat)]
    if args.repeat > 1:
        for key, label in (("loader", "loader line"), ("ready", "answering"), ("token", "token")):
            values = [run[key] for run in runs if key in run]
            if values:
                figures = ", ".join(f"{v:.2f}" for v in values)
                print(f"{label}: median {statistics.median(values):.2f} s ({figures})")


if __name__ == "__main__":
    main()
