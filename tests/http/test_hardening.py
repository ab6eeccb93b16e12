"""Issue 23: large inputs off the event loop, atomic admission, slow and idle connections,
client disconnects mid-upload, deep JSON, request-log bounds and the auth scheme."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http.conftest import API_KEY, ServerProcess, require_model, wait_idle

ARGS = [
    "--max-model-len", "2048",
    "--kv-cache-memory", "128M",
    "--max-num-seqs", "1",
    "--max-waiting-requests", "2",
    "--max-request-body-bytes", "8M",
    "--timeout-request-header", "1",
    "--timeout-request-body", "1",
    "--timeout-keep-alive", "1",
    "--shutdown-timeout", "2",
    "--enable-log-requests",
    "--limit-concurrency", "32",
]  # fmt: skip


@pytest.fixture(scope="module")
def hard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model()
    # One torch thread: on a 2-core test machine the preprocessing thread then has a core
    # of its own, so a stall can only come from the event loop, which is what is tested.
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        proc = ServerProcess(ARGS, tmp_path_factory.mktemp("hardening"))
    finally:
        if old is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = old
    proc.wait_ready()
    yield proc
    code = proc.stop()
    logs = proc.logs()
    assert code == 0, logs[-3000:]
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 1000 :][:4000]


@pytest.fixture()
def hc(hard: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hard.base_url, timeout=60) as c:
        yield c


def _stream_chunk_times(base_url: str, started: threading.Event, times: list[float]) -> None:
    """Appends the arrival time of each chunk of one streamed completion to `times`."""
    body = {"prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                started.set()


def _longest_gap_during_batch(hc: httpx.Client) -> float:
    """The longest time between a running stream's tokens while the server handles a batch
    of large prompts (from its send until a second after its 400)."""
    started = threading.Event()
    times: list[float] = []
    streamer = threading.Thread(target=_stream_chunk_times, args=(hc.base_url, started, times))
    streamer.start()
    assert started.wait(60)
    # Under the bound each, but 480 of them (7.7 MB): seconds of tokenizing, in the pool,
    # then rejected as too long.
    batch = ["word " * 3200] * 480
    batch_sent = time.monotonic()
    response = hc.post("/v1/completions", json={"prompt": batch, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "max_model_len" in response.json()["error"]["message"]
    batch_done = time.monotonic()
    streamer.join(60)
    assert times[-1] > batch_done + 1, "the stream ended before the batch was handled"
    assert len(times) > 50
    gaps = [
        now - last
        for last, now in itertools.pairwise(times)
        if now > batch_sent and last < batch_done + 1
    ]
    return max(gaps)


def test_stream_keeps_flowing_while_large_prompts_are_handled(hc: httpx.Client) -> None:
    wait_idle(hc)
    # Over max_model_len x 8 characters: rejected before it is tokenized.
    t0 = time.monotonic()
    response = hc.post("/v1/completions", json={"prompt": "a " * 200_000, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert "characters per token" in response.json()["error"]["message"]
    assert time.monotonic() - t0 < 2
    # A tokenizer call that holds the GIL stalls every torch op of the step thread behind it,
    # in every attempt; a second attempt tells that apart from a moment's noise on a shared
    # 2-core machine (seen once: one 2.7 s gap).
    longest = _longest_gap_during_batch(hc)
    if longest >= 1.0:
        wait_idle(hc)
        longest = min(longest, _longest_gap_during_batch(hc))
    assert longest < 1.0, f"longest gap between tokens: {longest:.2f} s"


BURST = 24


def test_burst_admission_holds_the_waiting_limit(hc: httpx.Client) -> None:
    wait_idle(hc)
    body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "stream": True}

    def one(_: int) -> tuple[int, str | None]:
        with (
            httpx.Client(base_url=hc.base_url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as response,
        ):
            response.read()
            return response.status_code, response.headers.get("retry-after")

    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(one, range(BURST)))
    accepted = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(accepted) + len(rejected) == BURST, results
    # One running (--max-num-seqs 1) and two waiting at most; never the whole burst.
    assert 1 <= len(accepted) <= 3, results
    assert all(retry == "1" for _, retry in rejected)
    wait_idle(hc)


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(5)
    return sock


def _read_all(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    t0 = time.monotonic()
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


def test_slow_headers_idle_and_slow_body_get_408(hard: ServerProcess) -> None:
    with _raw(hard.port) as silent, _raw(hard.port) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for sock in (silent, slow):
            data, took = _read_all(sock)
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
            assert took < 3
    with _raw(hard.port) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        data, took = _read_all(sock)
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"--timeout-request-body" in data
        assert took < 3


def test_idle_keep_alive_connection_is_closed(hard: ServerProcess) -> None:
    with _raw(hard.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        data, took = _read_all(sock)
        assert data.startswith(b"HTTP/1.1 200"), data[:200]
        assert took < 3


def test_disconnect_mid_upload_is_one_quiet_line(hard: ServerProcess) -> None:
    for _ in range(3):
        with _raw(hard.port) as sock:
            sock.sendall(
                b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"pr'
            )
            time.sleep(0.2)
    time.sleep(0.5)
    logs = hard.logs()
    assert logs.count("client disconnected while sending /v1/completions") == 3, logs[-3000:]
    assert "Traceback" not in logs and "ERROR" not in logs, logs[-3000:]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["body", "schema-text", "schema"])
def test_deep_json_is_a_400_naming_the_limit(hc: httpx.Client, where: str) -> None:
    if where == "body":
        raw = '{"prompt": "hi", "max_tokens": 1, "x": ' + _deep(100_000) + "}"
    elif where == "schema-text":
        schema = '"' + _deep(100_000) + '"'
        raw = '{"prompt": "hi", "max_tokens": 1, "structured_outputs": {"json": ' + schema + "}}"
    else:
        schema = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
        raw = '{"prompt": "hi", "max_tokens": 1, "structured_outputs": {"json": ' + schema + "}}"
    response = hc.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text[:500]
    assert "the limit is 128" in response.json()["error"]["message"]


def test_request_log_is_bounded_by_default(hard: ServerProcess, hc: httpx.Client) -> None:
    prompt = "the " * 700  # 2.8 KB, ~700 tokens
    response = hc.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 200, response.text
    lines = [line for line in hard.logs().splitlines() if "the the" in line]
    assert lines and all(len(line) < 8 * 512 + 2000 for line in lines), len(lines[0])


def test_bearer_scheme_is_case_insensitive(server: ServerProcess) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 200
    wrong = {"Authorization": f"Basic {API_KEY}"}
    assert httpx.get(f"{server.base_url}/v1/models", headers=wrong).status_code == 401


def test_explosive_regex_is_rejected_at_validation(hc: httpx.Client) -> None:
    body = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(a{1000}){1000}"}}
    t0 = time.monotonic()
    response = hc.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "the limit is 10000" in error["message"]
    assert error["param"] == "structured_outputs.regex" or "regex" in error["message"]
    assert time.monotonic() - t0 < 1
    body["structured_outputs"] = {"regex": "(a{10}){10}"}
    assert hc.post("/v1/completions", json=body).status_code == 200


def test_null_content_names_the_message(hc: httpx.Client) -> None:
    body = {"messages": [{"role": "system", "content": "Hi"}, {"role": "user", "content": None}]}
    response = hc.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[1].content"


def test_limit_concurrency_answers_503(hard: ServerProcess, hc: httpx.Client) -> None:
    idle = [_raw(hard.port) for _ in range(32)]
    try:
        time.sleep(0.2)  # every connection accepted (well inside the 1 s header timeout)
        with httpx.Client(base_url=hard.base_url, timeout=5) as fresh:
            response = fresh.get("/health")
        assert response.status_code == 503, response.text
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert hc.get("/health").status_code == 200


def test_openapi_has_bounds_and_401s() -> None:
    from asyncserve.http.openapi import openapi_schema

    schema = openapi_schema("test", auth=True)
    top_p = schema["components"]["schemas"]["CompletionRequest"]["properties"]["top_p"]
    assert {"type": "number", "exclusiveMinimum": 0, "maximum": 1}.items() <= top_p["anyOf"][
        0
    ].items()
    for path in ("/v1/models", "/version"):
        assert "401" in schema["paths"][path]["get"]["responses"]
