"""A second server, over TLS, with one sequence at a time and one waiting request allowed:
TLS with a self-signed certificate, 503 + Retry-After when the queue is full, and a SIGTERM
drain (the test that ends this server, so it runs last)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import ServerProcess, require_model, sse_events

pytestmark = pytest.mark.timeout(300)


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncserve test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


class TLSServer(ServerProcess):
    ssl_context: ssl.SSLContext

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, verify=self.ssl_context, timeout=timeout)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSServer]:
    require_model()
    directory = tmp_path_factory.mktemp("tls")
    key, cert = make_self_signed(directory)
    args = [
        "--max-model-len", "1024",
        "--kv-cache-memory", "64M",
        "--max-num-seqs", "1",
        "--max-waiting-requests", "1",
        "--shutdown-timeout", "120",
        "--scheduling-policy", "priority",
        "--ssl-keyfile", str(key),
        "--ssl-certfile", str(cert),
    ]  # fmt: skip
    server = TLSServer(args, directory, scheme="https")
    server.ssl_context = ssl.create_default_context(cafile=str(cert))
    server.wait_ready(verify=server.ssl_context)
    yield server
    server.stop()


def test_tls_verified_against_the_test_cert(tls_server: TLSServer) -> None:
    with tls_server.client() as client:
        out = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert out.status_code == 200, out.text
        assert client.get("/health").json()["status"] == "ok"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls_server.base_url}/health")  # the system CAs do not know this cert
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health")  # plain HTTP is not served


def _wait_for(client: httpx.Client, running: int, waiting: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = client.get("/health").json()
        if health["num_running"] == running and health["num_waiting"] == waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"expected {running} running, {waiting} waiting; got {health}")


def test_full_queue_gets_503_with_retry_after(tls_server: TLSServer) -> None:
    long = {"prompt": "Tell me a story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with (
        tls_server.client() as client,
        tls_server.client() as a,
        tls_server.client() as b,
        a.stream("POST", "/v1/completions", json=long) as first,
    ):
        assert first.status_code == 200
        _wait_for(client, running=1, waiting=0)
        with b.stream("POST", "/v1/completions", json=long) as second:
            assert second.status_code == 200
            _wait_for(client, running=1, waiting=1)
            for path, body in (
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                ("/generate", {"prompt": "Hi"}),
            ):
                response = client.post(path, json=body)
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "1"
                error = response.json()["error"]
                assert error["type"] == "ServiceUnavailableError"
                assert "--max-waiting-requests" in error["message"]
            assert client.get("/health").status_code == 200  # overloaded, not unhealthy
    with tls_server.client() as client:
        _wait_for(client, running=0, waiting=0)
        health = client.get("/health").json()
        assert health["num_free_blocks"] == health["num_total_blocks"]
        out = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert out.status_code == 200  # room again


def test_priority_is_accepted_with_the_priority_policy(tls_server: TLSServer) -> None:
    with tls_server.client() as client:
        for priority in (-5, 0, 7):
            out = client.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": priority}
            )
            assert out.status_code == 200, out.text


def test_sigterm_drains_then_exits_0(tls_server: TLSServer) -> None:
    body = {"prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with (
        tls_server.client() as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        tls_server.proc.send_signal(signal.SIGTERM)
        # New connections are not served while the running stream goes on: either the
        # listening socket is already closed (connect refused) or a connection that slipped
        # into the backlog just before is closed unanswered.
        deadline = time.monotonic() + 10
        refused = False
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(f"{tls_server.base_url}/health", verify=tls_server.ssl_context, timeout=2)
                time.sleep(0.1)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                refused = True
        assert refused, "the server still accepts connections after SIGTERM"
        assert tls_server.proc.poll() is None  # still draining
        rest = [line for line in lines if line.startswith("data: ")]
    raw = "\n\n".join([first, *rest]) + "\n\n"
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40  # the whole request was served
    assert tls_server.proc.wait(timeout=60) == 0, tls_server.logs()[-3000:]
    assert "Traceback" not in tls_server.logs(), tls_server.logs()[-6000:]
