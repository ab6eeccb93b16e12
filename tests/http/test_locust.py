"""The locust load script runs headless for a few seconds against the real server, cleanly."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from tests.http.conftest import API_KEY, REPO, ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.mark.skipif(
    importlib.util.find_spec("locust") is None,
    reason="locust is not installed (pip install locust)",
)
def test_locust_headless_run(server: ServerProcess) -> None:
    locust = shutil.which("locust")
    cmd = [locust] if locust else [sys.executable, "-m", "locust"]
    cmd += [
        "-f", str(REPO / "loadtests" / "locustfile.py"),
        "--headless", "-u", "4", "-r", "4", "-t", "8s",
        "--host", server.base_url,
        "--api-key", API_KEY,
        "--max-tokens", "8",
        "--stop-timeout", "60",
        "--json", "--only-summary",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = {entry["name"]: entry for entry in json.loads(result.stdout)}
    stream = stats["/v1/chat/completions (stream)"]
    assert stream["num_requests"] >= 1, stats
    assert stream["num_failures"] == 0, result.stderr[-3000:]
    assert stats["time to first token"]["num_requests"] >= 1
