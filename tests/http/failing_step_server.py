"""`python -m tests.http.failing_step_server PORT`: the real server on the default model,
whose device step raises once a request with max_tokens == FAIL_MARKER is scheduled. It
stands for a device fault (the engine cannot continue); the test checks that the server
fails the requests in flight and exits non-zero instead of answering 503 forever."""

from __future__ import annotations

import sys
from typing import Any

from asyncserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from asyncserve.engine.async_engine import AsyncEngine
from asyncserve.http.server import run_server

FAIL_MARKER = 13


def main() -> int:
    port = int(sys.argv[1])
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(max_model_len=512), cache=CacheConfig(kv_cache_memory=32 << 20)
        )
    )
    launch_forward = engine.runner.launch_forward

    def failing_launch_forward(plan: Any, *args: Any) -> Any:
        if any(r.sampling_params.max_tokens == FAIL_MARKER for r in plan.new_requests):
            raise RuntimeError("device fault")
        return launch_forward(plan, *args)

    engine.runner.launch_forward = failing_launch_forward  # type: ignore[method-assign]
    return run_server(engine, ServerConfig(port=port, shutdown_timeout=2))


if __name__ == "__main__":
    sys.exit(main())
