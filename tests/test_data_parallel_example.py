"""examples/data_parallel.py (vLLM's SPMD data-parallel example, adapted) runs two ranks on
CPU with the default model, each printing its own outputs, and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.http.conftest import REPO, require_model

pytestmark = pytest.mark.timeout(300)


def test_example_runs_two_ranks() -> None:
    require_model()
    argv = [sys.executable, "examples/data_parallel.py", "--dp-size", "2", "--tp-size", "1",
            "--max-model-len", "256", "--timeout", "240"]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    for rank in (0, 1):
        assert f"DP rank {rank} needs to process 8 prompts" in done.stdout
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(f"DP rank {rank}, Prompt")]
        assert len(lines) == 5, done.stdout
        assert all("Generated text: ''" not in ln for ln in lines), done.stdout
