"""Issue 23, item 6: SIGTERM with streams in flight ends them with an error event and
[DONE] at the --shutdown-timeout deadline (non-streaming requests with a JSON 503), and the
process exits soon after; an idle server exits at once."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

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


def test_requests_cut_at_the_deadline_end_cleanly(tmp_path: Path) -> None:
    proc = _start(tmp_path, 2)
    bodies: list[str] = []
    answers: list[httpx.Response] = []
    long = {"max_tokens": 1900, "ignore_eos": True}

    def stream() -> None:
        body = {"prompt": "Once", "stream": True, **long}
        with (
            httpx.Client(base_url=proc.base_url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            bodies.append("".join(response.iter_text()))

    def ask(path: str, body: dict[str, Any]) -> None:
        answers.append(httpx.post(f"{proc.base_url}{path}", json={**body, **long}, timeout=60))

    chat = {"messages": [{"role": "user", "content": "Once"}]}
    threads = [threading.Thread(target=stream) for _ in range(2)] + [
        threading.Thread(target=ask, args=("/v1/completions", {"prompt": "Once"})),
        threading.Thread(target=ask, args=("/v1/chat/completions", chat)),
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{proc.base_url}/health").json()["num_running"] < len(threads):
            assert time.monotonic() < deadline, "the requests did not all start"
            time.sleep(0.05)
        took = _sigterm_and_time_exit(proc, 3)
        for t in threads:
            t.join(10)
        assert len(bodies) == 2
        for raw in bodies:
            events = sse_events(raw)
            assert events[-1] == "[DONE]", raw[-300:]
            assert '"error"' in events[-2] and "shutting down" in events[-2], events[-2]
        # Non-streaming: the error in OpenAI's JSON shape, not uvicorn's plain-text 500.
        assert len(answers) == 2
        for response in answers:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "ServiceUnavailableError", error
            assert "shutting down" in error["message"], error
        assert took < 2 + 1, f"exited {took:.1f} s after SIGTERM (--shutdown-timeout 2)"
        logs = proc.logs()
        assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]
    finally:
        proc.stop()
