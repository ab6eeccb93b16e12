"""build_app called in-process (httpx.ASGITransport) around the real engine: /health follows the
engine loop (503 before start and after shutdown), requests work without a socket."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from asyncserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from asyncserve.http.app import build_app, default_model_name
from tests.http.conftest import require_model

pytestmark = pytest.mark.timeout(300)


def test_health_follows_the_engine_loop() -> None:
    require_model()
    from asyncserve.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(max_model_len=256), cache=CacheConfig(kv_cache_memory=16 << 20)
        )
    )
    app = build_app(engine, ServerConfig(shutdown_timeout=5))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            before = await client.get("/health")
            assert before.status_code == 503 and before.json()["status"] == "unhealthy"
            refused = await client.post("/v1/completions", json={"prompt": "Hi"})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            async with app.router.lifespan_context(app):
                assert (await client.get("/health")).status_code == 200
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] == [default_model_name(engine.model_path)]
                out = await client.post(
                    "/v1/completions",
                    json={"prompt": "The capital of France is", "max_tokens": 4,
                          "temperature": 0},
                )  # fmt: skip
                assert out.status_code == 200 and "Paris" in out.json()["choices"][0]["text"]
            after = await client.get("/health")
            assert after.status_code == 503

    asyncio.run(main())


def test_default_model_name() -> None:
    assert default_model_name("/a/b/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert default_model_name("/models/Llama-3-8B") == "Llama-3-8B"
