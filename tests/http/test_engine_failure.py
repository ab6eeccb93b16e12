"""A request that used to stop the engine is answered, and an engine that fails for good
makes the server exit non-zero (a supervisor restarts it) instead of answering 503 forever."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.http.conftest import MODEL, REPO, free_port, require_model, sse_events, wait_healthy
from tests.http.failing_step_server import FAIL_MARKER

pytestmark = pytest.mark.timeout(300)


def test_echo_logprobs_with_n_is_served(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Paris is a city in", "echo": True, "logprobs": 1,
            "n": 2, "max_tokens": 4}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["text"].startswith("Paris is a city in")
        logprobs = choice["logprobs"]
        # The prompt's tokens (the first has no logprob) and then the 4 sampled ones.
        assert logprobs["token_logprobs"][0] is None
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) > 4
    assert client.get("/health").status_code == 200
    again = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert again.status_code == 200


def test_server_exits_non_zero_when_the_engine_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_model()
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.http.failing_step_server", str(port)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                        timeout=60)  # fmt: skip
        assert ok.status_code == 200
        body = {"prompt": "Hi", "max_tokens": FAIL_MARKER, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            raw = "".join(r.iter_text())
        events = sse_events(raw)
        assert "device fault" in events[0] and events[-1] == "[DONE]", raw
        assert proc.wait(timeout=30) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "exiting with status 1" in log.read_text()
