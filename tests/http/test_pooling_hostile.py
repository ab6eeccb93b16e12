"""Pooling routes against huge input lists (in-process, tiny BERT): answered whole, with
bad items a 400 naming `input` before any work; a small request sent after a huge one is
answered long before it (batches take each request's items in turn)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from asyncserve.config import EngineConfig, ModelConfig, ServerConfig
from asyncserve.http.app import build_app
from asyncserve.pooling.engine import PoolingEngine
from tests.pooling.conftest import st_bert_dir  # noqa: F401

pytestmark = pytest.mark.timeout(300)
HUGE = 30_000


def test_huge_input_lists_do_not_starve_others(st_bert_dir: Path) -> None:  # noqa: F811
    engine = PoolingEngine.from_config(EngineConfig(model=ModelConfig(model=str(st_bert_dir))))
    app = build_app(engine, ServerConfig(served_model_names=("m",)))

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app", timeout=300) as client,
            app.router.lifespan_context(app),
        ):
            done: dict[str, float] = {}

            async def post(name: str, path: str, body: object) -> httpx.Response:
                reply = await client.post(path, json=body)
                done[name] = time.perf_counter()
                return reply

            huge = asyncio.create_task(post("huge", "/v1/embeddings", {"input": ["a b"] * HUGE}))
            while not engine.num_running:  # the huge request's first batch is running
                await asyncio.sleep(0.001)
            small = await post("small", "/v1/embeddings", {"input": ["the cat", "a dog"]})
            assert small.status_code == 200 and len(small.json()["data"]) == 2
            big = await huge
            assert big.status_code == 200, big.text[:500]
            data = big.json()["data"]
            assert [d["index"] for d in data] == list(range(HUGE))
            assert data[0]["embedding"] == data[-1]["embedding"]
            assert done["small"] < done["huge"]
            # A bad item anywhere in a huge list: 400 naming input, nothing run.
            ids = [[5, 6]] * HUGE + [[10**9]]
            bad = await client.post("/v1/embeddings", json={"input": ids})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
            assert "outside the vocabulary" in bad.json()["error"]["message"]
            score = await client.post("/score", json={"text_1": "a", "text_2": ["b"] * 5000})
            assert score.status_code == 200 and len(score.json()["data"]) == 5000
            assert engine.num_waiting == 0

    asyncio.run(main())
