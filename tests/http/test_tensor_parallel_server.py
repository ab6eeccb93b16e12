"""`serve -tp 2` on CPU: it answers, and when a worker process is killed (the server idle)
the server exits 1 and no worker process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import save_file

from tests.http.conftest import REPO, free_port, wait_healthy
from tests.models.test_loader import random_state, write_config

pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The parent pid is the 2nd field after the parenthesised command name.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_server_exits_1_when_a_worker_dies(tmp_path: Path) -> None:
    root = write_config(tmp_path / "llama")
    save_file(random_state(), str(root / "model.safetensors"))
    port = free_port()
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "asyncserve", "serve", "--model", str(root), "-tp", "2",
            "--device", "cpu", "--dtype", "float32", "--port", str(port)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base, log)
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        # The spawned workers (multiprocessing also starts a resource tracker: skip it).
        workers = [p for p in _children(proc.pid) if b"spawn_main" in _cmdline(p)]
        assert len(workers) == 2, workers
        os.kill(workers[-1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "died" in log.read_text()
    assert not any(_alive(pid) for pid in workers)


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""
