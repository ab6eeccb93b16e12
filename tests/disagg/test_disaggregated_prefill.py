"""Disaggregated prefill on loopback: a producer, a consumer and the proxy in front, as three
real processes on SmolLM2. Greedy output equals one server's; blocks the consumer caches
already are not sent again; a lost transfer fails only its own request; the proxy fails over."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import REPO, ServerProcess, free_port, require_model, wait_healthy

KEY = "disagg-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMMON = ["--max-model-len", "1024", "--kv-cache-memory", "48M", "--served-model-name", "smol",
          "--api-key", KEY, "--shutdown-timeout", "2"]  # fmt: skip
# Long enough for several full blocks of 16 tokens.
PROMPT = (
    "The history of the river begins in the mountains, where snow melts each spring and "
    "runs down through forests and villages toward the sea. Along the way it turns mills, "
    "feeds farms, and carries boats loaded with grain and timber. Tell me how it ends:"
)


def _counter(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    found = re.findall(rf"^asyncserve:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    require_model()
    logs = tmp_path_factory.mktemp("disagg")
    producer = ServerProcess(
        [
            *COMMON,
            "--kv-transfer-config",
            '{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}',
        ],
        logs,
    )
    consumer = ServerProcess(
        [
            *COMMON,
            "--kv-transfer-config",
            '{"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}',
        ],
        logs,
    )
    port = free_port()
    proxy_log = logs / "proxy.log"
    with open(proxy_log, "wb") as out:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "asyncserve", "proxy", "--port", str(port),
             "--prefill", producer.base_url, "--decode", consumer.base_url],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        producer.wait_ready()
        consumer.wait_ready()
        wait_healthy(proxy, f"http://127.0.0.1:{port}", proxy_log)
        yield {"producer": producer, "consumer": consumer, "proxy": f"http://127.0.0.1:{port}"}
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(30)
        for server in (consumer, producer):
            server.stop()


def _complete(base: str, prompt: str, **extra: object) -> httpx.Response:
    body = {"model": "smol", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120)


def test_greedy_through_the_proxy_equals_one_server(cluster: dict[str, object]) -> None:
    consumer, proxy = cluster["consumer"], str(cluster["proxy"])
    assert isinstance(consumer, ServerProcess)
    received_before = _counter(consumer.base_url, "kv_transfer_blocks_received")
    via_proxy = _complete(proxy, PROMPT)
    assert via_proxy.status_code == 200, via_proxy.text
    received = _counter(consumer.base_url, "kv_transfer_blocks_received") - received_before
    assert received >= 3  # the prompt's full blocks came from the producer
    usage = via_proxy.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == received * 16
    # The same prompt on one server, computed there: the same tokens.
    producer = cluster["producer"]
    assert isinstance(producer, ServerProcess)
    reference = _complete(producer.base_url, PROMPT)
    assert reference.json()["choices"][0]["text"] == via_proxy.json()["choices"][0]["text"]
    # Streams work through the proxy too.
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "smol", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8, "temperature": 0, "stream": True,
    }) as stream:  # fmt: skip
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3


def test_cached_blocks_are_not_sent_again(cluster: dict[str, object]) -> None:
    producer, consumer, proxy = cluster["producer"], cluster["consumer"], str(cluster["proxy"])
    assert isinstance(producer, ServerProcess) and isinstance(consumer, ServerProcess)
    first = _complete(proxy, "Question one. " + PROMPT)
    assert first.status_code == 200, first.text
    sent = _counter(producer.base_url, "kv_transfer_blocks_sent")
    again = _complete(proxy, "Question one. " + PROMPT)
    assert again.status_code == 200
    assert _counter(producer.base_url, "kv_transfer_blocks_sent") == sent  # all cached already
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_lost_transfer_fails_only_its_request(tmp_path: Path, cluster: dict[str, object]) -> None:
    consumer = cluster["consumer"]
    assert isinstance(consumer, ServerProcess)
    # A producer of its own, killed between its prefill and the consumer's pull.
    producer = ServerProcess(
        [
            *COMMON,
            "--kv-transfer-config",
            '{"kv_connector": "TCPConnector", "kv_role": "kv_producer"}',
        ],
        tmp_path,
    )
    producer.wait_ready()
    prompt = "A lost transfer. " + PROMPT
    prefilled = _complete(producer.base_url, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = prefilled.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_hashes"]
    producer.proc.kill()
    producer.stop()
    lost = _complete(consumer.base_url, prompt,
                     kv_transfer_params={**params, "remote_url": producer.base_url})  # fmt: skip
    # A non-streaming response carries finish_reason "error"; the log says why.
    assert lost.json()["choices"][0]["finish_reason"] == "error", lost.text
    assert f"KV transfer from {producer.base_url} failed" in consumer.logs()
    # The consumer goes on serving.
    assert _complete(consumer.base_url, "Hello there").status_code == 200


def test_bad_kv_transfer_params_are_400(cluster: dict[str, object]) -> None:
    consumer = cluster["consumer"]
    assert isinstance(consumer, ServerProcess)
    wrong_role = _complete(consumer.base_url, "Hi", kv_transfer_params={"do_remote_decode": True})
    assert wrong_role.status_code == 400 and "producer" in wrong_role.text
    incomplete = _complete(consumer.base_url, "Hi", kv_transfer_params={"do_remote_prefill": True})
    assert incomplete.status_code == 400 and "remote_url" in incomplete.text
    assert incomplete.json()["error"]["param"] == "kv_transfer_params"
    # The consumer POSTs to remote_url + /kv_transfer/pull: nothing but a producer's base URL
    # (a file: URL was read from disk, a '#' cut the pull path off).
    pull = {"do_remote_prefill": True, "remote_request_id": "x", "remote_block_hashes": [1]}
    for url, problem in (
        ("file:///etc/passwd#", "http:// or https://"),
        ("http://127.0.0.1:1/v1/models#", "query or fragment"),
        ("http://127.0.0.1:1/admin?", "query or fragment"),
        ("http://user:pw@127.0.0.1:1", "credentials"),
        ("http:///x", "no host"),
        ("http://127.0.0.1:99999", "not valid"),
    ):
        bad = _complete(consumer.base_url, PROMPT, kv_transfer_params={**pull, "remote_url": url})
        assert bad.status_code == 400 and problem in bad.text, (url, bad.text)
        assert bad.json()["error"]["param"] == "kv_transfer_params"
    assert "KV transfer from file:" not in consumer.logs()


def test_proxy_drops_client_kv_transfer_params(cluster: dict[str, object]) -> None:
    from asyncserve.disagg.proxy import build_proxy

    consumer = cluster["consumer"]
    assert isinstance(consumer, ServerProcess)
    dead = f"http://127.0.0.1:{free_port()}"
    aimed = {"do_remote_prefill": True, "remote_url": dead, "remote_request_id": "x",
             "remote_block_hashes": [1, 2, 3]}  # fmt: skip
    # No prefill instance is up, so only the client's params could reach the consumer.
    app = build_proxy([dead], [consumer.base_url])
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": aimed}

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            return await client.post("/v1/completions", json=body, headers=AUTH, timeout=120)

    reply = asyncio.run(ask())
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length", reply.text
    assert f"KV transfer from {dead}" not in consumer.logs()


def test_proxy_fails_over_to_live_instances(tmp_path: Path, cluster: dict[str, object]) -> None:
    producer, consumer = cluster["producer"], cluster["consumer"]
    assert isinstance(producer, ServerProcess) and isinstance(consumer, ServerProcess)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    port = free_port()
    log = tmp_path / "proxy.log"
    with open(log, "wb") as out:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "asyncserve", "proxy", "--port", str(port),
             "--prefill", dead, producer.base_url, "--decode", dead, consumer.base_url],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proxy, base, log)
        received = _counter(consumer.base_url, "kv_transfer_blocks_received")
        prompt = "Fail over. " + PROMPT
        answers = [_complete(base, prompt) for _ in range(2)]  # each role's turn hits the dead one
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]
        assert _counter(consumer.base_url, "kv_transfer_blocks_received") > received
        assert "is down" in log.read_text()
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(30)


def _pull(producer: ServerProcess, request_id: str, hashes: list[int]) -> bytes:
    body = {"request_id": request_id, "block_hashes": hashes}
    reply = httpx.post(f"{producer.base_url}/kv_transfer/pull", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    return reply.content


def test_a_pull_reads_only_its_own_requests_blocks(cluster: dict[str, object]) -> None:
    from asyncserve.disagg.kv_transfer import _metadata

    producer = cluster["producer"]
    assert isinstance(producer, ServerProcess)
    prefilled = _complete(producer.base_url, "Own blocks. " + PROMPT, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = prefilled.json()["kv_transfer_params"]
    hashes = params["remote_block_hashes"]
    # Another id gets nothing (the cache is no oracle of other prompts) and frees nothing.
    assert _metadata(_pull(producer, "not-a-request", hashes))["block_hashes"] == "[]"
    # The right id gets each held block once, however often it is named.
    blob = _pull(producer, params["remote_request_id"], hashes * 20)
    assert json.loads(_metadata(blob)["block_hashes"]) == hashes


def test_a_reply_naming_blocks_not_asked_for_is_refused(cluster: dict[str, object]) -> None:
    from safetensors.torch import load, save

    producer, consumer = cluster["producer"], cluster["consumer"]
    assert isinstance(producer, ServerProcess) and isinstance(consumer, ServerProcess)

    def prefill(prompt: str) -> dict[str, Any]:
        reply = _complete(producer.base_url, prompt, max_tokens=1,
                          kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        params: dict[str, Any] = reply.json()["kv_transfer_params"]
        return params

    victim, mine = "Someone else. " + PROMPT, "Mine. " + PROMPT
    theirs = prefill(victim)["remote_block_hashes"]
    ours = prefill(mine)
    kv = load(_pull(producer, ours["remote_request_id"], ours["remote_block_hashes"]))["kv"]
    n = min(len(theirs), len(kv))
    # A rogue producer: real K/V of one prompt, named as another prompt's blocks.
    forged = save({"kv": kv[:n].contiguous()}, metadata={"block_hashes": json.dumps(theirs[:n])})

    class Rogue(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(forged)))
            self.end_headers()
            self.wfile.write(forged)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rogue = f"http://127.0.0.1:{server.server_address[1]}"
        refused = _complete(
            consumer.base_url, mine, kv_transfer_params={**ours, "remote_url": rogue}
        )
        assert refused.json()["choices"][0]["finish_reason"] == "error", refused.text
    finally:
        server.shutdown()
    # Nothing joined the consumer's prefix cache under the other prompt's hashes.
    other = _complete(consumer.base_url, victim)
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, other.text


def test_several_sequences_through_the_proxy(cluster: dict[str, object]) -> None:
    # n > 1 (or a batch) is not disaggregated: the decode instance computes the prompt.
    proxy = str(cluster["proxy"])
    several = _complete(proxy, "Two answers. " + PROMPT, n=2)
    assert several.status_code == 200 and len(several.json()["choices"]) == 2, several.text
    batch = _complete(proxy, ["One. " + PROMPT, "Two. " + PROMPT])
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2, batch.text
