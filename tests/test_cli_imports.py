"""`serve` imports only what serving needs before the model loads (cold start, W5).

Each module here costs start-up time and is needed only by a feature that imports it when
used or when its flag is set: a later change that brings one back at import time fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Feature-only dependencies: tokenizer conversion and HF peers, Ray, tracing, images, GGUF
# files, the proxy's HTTP client (and the CLI tools it pulls in), the GPU kernels' compiler.
NOT_AT_START = (
    "transformers",
    "sentence_transformers",
    "accelerate",
    "peft",
    "ray",
    "opentelemetry",
    "PIL",
    "gguf",
    "httpx",
    "rich",
    "pygments",
    "triton",
    "asyncserve.bench.serve",
    "asyncserve.models.gguf_loader",
)

# What `asyncserve serve` imports before the engine loads the model (asyncserve/cli.py).
SERVE_START = """
import json, sys
from asyncserve import cli
parser = cli.build_parser("serve")  # as cli.main builds it for serve
args = parser.parse_args(["serve", "--model", "benchmarks/configs/llama-tiny"])
env = cli.Environment.read()
cli.server_config_from_args(args, env)
cli.engine_config_from_args(args, env)
cli._import_serve_modules(data_parallel=False)
import asyncserve.pooling.config, asyncserve.pooling.engine  # build_engine's own imports
print(json.dumps(sorted(sys.modules)))
"""


def test_serve_start_imports_no_feature_only_modules() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SERVE_START],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" in modules and "asyncserve.engine.async_engine" in modules
    loaded = sorted(
        m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_AT_START)
    )
    assert loaded == []
