"""Issue 23, item 6: SIGTERM with streams in flight ends them with an error event and
[DONE] at the --shutdown-timeout deadline, and the process exits soon after; an idle
server exits at once."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.http.conftest import ServerProcess, require_model, sse_events

ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "128M", "--max-num-seqs", "4"]


def _start(tmp_path: Path, timeout_s: float) -> ServerProcess:
    require_model()
    proc = ServerProcess([*ARGS, "--shutdown-timeout", str(timeout_s)], tmp_path)
    proc.wait_ready()
    return proc


def _sigterm_and_time_exit(proc: ServerProcess, limit_s: float) -> float:
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(limit_s + 10)
    took = time.monotonic() - t0
    assert code == 0, proc.logs()[-3000:]
    return took


def test_idle_server_exits_within_two_seconds(tmp_path: Path) -> None:
    proc = _start(tmp_path, 30)
    try:
        httpx.get(f"{proc.base_url}/health")  # a kept-alive connection is no reason to wait
        took = _sigterm_and_time_exit(proc, 2)
        assert took < 2, f"idle server took {took:.1f} s to exit"
    finally:
        proc.stop()


def test_streams_cut_at_the_deadline_end_cleanly(tmp_path: Path) -> None:
    proc = _start(tmp_path, 2)
    bodies: list[str] = []
    started = threading.Barrier(3)

    def stream() -> None:
        body = {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=proc.base_url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            chunks = response.iter_text()
            first = next(chunks)
            started.wait(30)
            bodies.append(first + "".join(chunks))

    threads = [threading.Thread(target=stream) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        started.wait(60)
        took = _sigterm_and_time_exit(proc, 3)
        for t in threads:
            t.join(10)
        assert took < 2 + 1, f"exited {took:.1f} s after SIGTERM (--shutdown-timeout 2)"
        assert len(bodies) == 2
        for raw in bodies:
            events = sse_events(raw)
            assert events[-1] == "[DONE]", raw[-300:]
            assert '"error"' in events[-2] and "shutting down" in events[-2], events[-2]
    finally:
        proc.stop()
