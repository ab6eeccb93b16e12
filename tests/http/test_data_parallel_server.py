"""`serve -dp 2` on CPU: streams through the OpenAI SDK, /metrics labels both replicas and
their total, and a killed replica fails its request with a clear error (503) and makes the
server exit 1 with no replica left behind."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.conftest import ServerProcess, require_model, sse_events

pytestmark = pytest.mark.timeout(300)

ARGS = ["-dp", "2", "--max-model-len", "512", "--kv-cache-memory", "64M",
        "--served-model-name", "smol", "--shutdown-timeout", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model()
    server = ServerProcess(ARGS, tmp_path_factory.mktemp("dp"))
    server.wait_ready()
    yield server
    server.stop()


def _replica_pids(server: ServerProcess) -> list[int]:
    match = re.search(r"2 data-parallel replicas ready \(pids \[(\d+), (\d+)\]\)", server.logs())
    assert match, server.logs()[-3000:]
    return [int(match.group(1)), int(match.group(2))]


def _samples(base_url: str) -> dict[tuple[str, str], float]:
    body = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:  # summed over the other labels (finished_reason)
            key = (s.name, s.labels.get("engine", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_streams_and_metrics_show_both_replicas(dp_server: ServerProcess) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{dp_server.base_url}/v1", api_key="x", max_retries=0)

    def stream(prompt: str) -> str:
        chunks = client.completions.create(
            model="smol", prompt=prompt, max_tokens=8, temperature=0.0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon"]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(stream, prompts))
    assert all(texts), texts
    # Requests one after another go round the replicas too.
    assert stream("The capital of France is") == texts[0]
    health = httpx.get(f"{dp_server.base_url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    s = _samples(dp_server.base_url)
    per_replica = [s[("asyncserve:request_success_total", str(i))] for i in (0, 1)]
    assert all(n > 0 for n in per_replica), per_replica
    assert s[("asyncserve:generation_tokens_total", "total")] == sum(
        s[("asyncserve:generation_tokens_total", str(i))] for i in (0, 1)
    )
    assert s[("asyncserve:generation_tokens_total", "total")] == 5 * 8
    assert ("asyncserve:num_requests_running", "total") in s


def test_replicas_outlive_the_signals_their_process_group_gets(dp_server: ServerProcess) -> None:
    """Ctrl-C (SIGINT) and systemd's stop (SIGTERM) reach every process of the group; the
    replicas leave the drain to the front end instead of failing their requests."""
    base = dp_server.base_url
    body = {"model": "smol", "prompt": "Count to a hundred:", "max_tokens": 60,
            "ignore_eos": True, "temperature": 0.0, "stream": True}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:

        def streamed() -> list[str]:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                return sse_events("".join(r.iter_text()))

        result = pool.submit(streamed)
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health", timeout=10).json()["num_running"] < 1:
            assert time.monotonic() < deadline, dp_server.logs()[-3000:]
            time.sleep(0.05)
        for pid in _replica_pids(dp_server):
            os.kill(pid, signal.SIGINT)
            os.kill(pid, signal.SIGTERM)
        events = result.result()
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    assert '"finish_reason":"length"' in events[-2], events[-3:]
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200, dp_server.logs()[-3000:]


def test_killed_replica_fails_its_request_and_the_server_exits_1(
    dp_server: ServerProcess,
) -> None:
    """Last in the module: it ends the shared server."""
    base = dp_server.base_url
    pids = _replica_pids(dp_server)
    long = {"model": "smol", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}

    def plain() -> httpx.Response:
        body = {**long, "prompt": "Tell me a very long story about a dragon."}
        return httpx.post(f"{base}/v1/completions", json=body, timeout=120)

    def streamed() -> list[str]:
        body = {**long, "prompt": "Write a long poem about the sea.", "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            return sse_events("".join(r.iter_text()))

    with ThreadPoolExecutor(2) as pool:
        results: list[Any] = [pool.submit(plain), pool.submit(streamed)]
        # Both requests running, one on each replica (the least loaded takes the second).
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health", timeout=10).json()["num_running"] < 2:
            assert time.monotonic() < deadline, dp_server.logs()[-3000:]
            time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        response, events = results[0].result(), results[1].result()
    # Exactly one request was on the killed replica: its error (503, or an SSE error event)
    # names the replica. The other runs on until the server's shutdown deadline cuts it (a
    # 503 saying so, or an error event).
    failed = [e for e in events if "data-parallel replica 0" in e]
    if response.status_code == 200:
        pass
    elif "data-parallel replica 0" in response.text:
        failed.append(response.json()["error"]["message"])
    else:
        assert response.status_code == 503 and "shutting down" in response.text, response.text
    assert len(failed) == 1, (response.text, events)
    assert "the engine stopped" in failed[0] and "died" in failed[0], failed
    assert dp_server.proc.wait(timeout=60) == 1, dp_server.logs()[-3000:]
    assert "data-parallel replica 0" in dp_server.logs()
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
