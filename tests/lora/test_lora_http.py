"""LoRA on the server (in-process ASGI around a real engine on the tiny Llama): adapters from
--lora-modules in /v1/models with their parent, `model` picks the adapter, runtime load and
unload behind the API key, a bad adapter is a 400 and the server keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, ServerConfig
from asyncserve.http.app import build_app
from asyncserve.metrics import EngineMetrics
from tests.lora.conftest import TinyLoRA, edit_config, hf_greedy

pytestmark = pytest.mark.timeout(300)
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 42, 7, 99, 250, 3, 18]
NUM_TOKENS = 6


def _engine(tiny_lora: TinyLoRA, metrics: EngineMetrics | None = None) -> Any:
    from asyncserve.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model=str(tiny_lora.base_path), dtype="float32", device="cpu"),
            cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4),
            lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16),
        ),
        metrics,
    )


async def _complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return await client.post("/v1/completions", json=body, headers=AUTH)


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"] or [])


def test_lora_over_http(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    a, b, _ = tiny_lora.adapters
    metrics = EngineMetrics("base")
    engine = _engine(tiny_lora, metrics)
    config = ServerConfig(
        served_model_names=("base",),
        api_key=KEY,
        lora_modules=(("ad-a", str(a.path)),),
        allow_runtime_lora_updating=True,
    )
    app = build_app(engine, config, metrics)
    bad = edit_config(a.path, tmp_path / "bad", r=64)

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            app.router.lifespan_context(app),
        ):
            models = (await client.get("/v1/models", headers=AUTH)).json()["data"]
            assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("ad-a", "base")]
            assert _ids(await _complete(client, "ad-a")) == hf_greedy(a.model, PROMPT, NUM_TOKENS)
            # vLLM's LoRA info gauge (adapters of live requests: none now).
            text = (await client.get("/metrics")).text
            assert 'asyncserve:lora_requests_info{max_lora="2",running_lora_adapters=""' in text
            assert _ids(await _complete(client, "base")) == hf_greedy(
                tiny_lora.base, PROMPT, NUM_TOKENS
            )

            load = {"lora_name": "ad-b", "lora_path": str(b.path)}
            # Behind the API key.
            denied = await client.post("/v1/load_lora_adapter", json=load)
            assert denied.status_code == 401
            loaded = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert loaded.status_code == 200 and "ad-b" in loaded.text
            again = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert again.status_code == 400 and "already been loaded" in again.text
            assert _ids(await _complete(client, "ad-b")) == hf_greedy(b.model, PROMPT, NUM_TOKENS)

            # Bad adapters: 400 naming the problem; the server goes on.
            for path, problem in ((bad, "max_lora_rank"), (tmp_path / "none", "not a directory")):
                body = {"lora_name": "bad", "lora_path": str(path)}
                refused = await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
                assert refused.status_code == 400 and problem in refused.json()["error"]["message"]
            missing = await client.post("/v1/load_lora_adapter", json={"lora_name": "x"},
                                        headers=AUTH)  # fmt: skip
            assert missing.status_code == 400 and "lora_path" in missing.text

            unload = {"lora_name": "ad-b"}
            gone = await client.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
            assert gone.status_code == 200
            unknown = await client.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
            assert unknown.status_code == 404
            after = await _complete(client, "ad-b")
            assert after.status_code == 400 and after.json()["error"]["param"] == "model"
            assert [
                m["id"] for m in (await client.get("/v1/models", headers=AUTH)).json()["data"]
            ] == [
                "base",
                "ad-a",
            ]
            assert _ids(await _complete(client, "ad-a")) == hf_greedy(a.model, PROMPT, NUM_TOKENS)

    asyncio.run(main())


def test_runtime_endpoints_need_the_switch(tiny_lora: TinyLoRA) -> None:
    engine = _engine(tiny_lora)
    app = build_app(engine, ServerConfig(served_model_names=("base",)))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            app.router.lifespan_context(app),
        ):
            body = {"lora_name": "x", "lora_path": str(tiny_lora.adapters[0].path)}
            response = await client.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 404

    asyncio.run(main())


def test_bad_startup_adapter_stops_the_server(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    engine = _engine(tiny_lora)
    bad = edit_config(tiny_lora.adapters[0].path, tmp_path / "bad", target_modules=["lm_head"])
    with pytest.raises(ValueError, match="target_modules"):
        build_app(engine, ServerConfig(lora_modules=(("bad", str(bad)),)))
