"""The pooling routes: /v1/embeddings through the OpenAI SDK against a real server on a
sentence-transformers BERT; /pooling, /score, /rerank, Matryoshka `dimensions` and the errors
in-process (httpx.ASGITransport) around real pooling engines, and the JSON 503 of a request
cut at the shutdown deadline."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from asyncserve.config import EngineConfig, ModelConfig, ServerConfig
from asyncserve.http.app import build_app
from asyncserve.pooling.engine import PoolingEngine
from tests.http.conftest import API_KEY, MODEL, ServerProcess
from tests.pooling.conftest import cross_encoder_dir, qwen3_body_dir, st_bert_dir  # noqa: F401

TEXTS = ["the cat sat on the mat", "paris is the capital of france"]


@pytest.fixture(scope="module")
def embed_server(st_bert_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # noqa: F811
    server = ServerProcess(
        ["--model", str(st_bert_dir), "--served-model-name", "emb", "--api-key", API_KEY],
        tmp_path_factory.mktemp("embed-server"),
    )
    try:
        server.wait_ready()
        yield server.base_url
    finally:
        assert server.stop() == 0, server.logs()[-3000:]


def test_embeddings_through_the_openai_sdk(embed_server: str, st_bert_dir: Path) -> None:  # noqa: F811
    import openai
    from sentence_transformers import SentenceTransformer

    client = openai.OpenAI(base_url=f"{embed_server}/v1", api_key=API_KEY)
    want = SentenceTransformer(str(st_bert_dir), device="cpu").encode(TEXTS)
    got = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1]
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-5)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    # The SDK's default asks for base64 and decodes it.
    packed = client.embeddings.create(model="emb", input=TEXTS[0])
    np.testing.assert_allclose(packed.data[0].embedding, want[0], atol=1e-5)
    # A generating route on a pooling server: 400 that says why.
    with pytest.raises(openai.BadRequestError, match="pooling model"):
        client.completions.create(model="emb", prompt="the cat", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="emb", input="the cat", dimensions=8)


def _app_call(model_dir: Path, calls: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    engine = PoolingEngine.from_config(EngineConfig(model=ModelConfig(model=str(model_dir))))
    app = build_app(engine, ServerConfig(served_model_names=("m",)))

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            app.router.lifespan_context(app),
        ):
            return [await client.post(path, json=body) for path, body in calls]

    return asyncio.run(main())


def test_score_and_rerank_with_a_cross_encoder(cross_encoder_dir: Path) -> None:  # noqa: F811
    from sentence_transformers import CrossEncoder

    docs = ["the sea", "a big city", "one two three"]
    want = CrossEncoder(str(cross_encoder_dir), device="cpu").predict(
        [("what is a river", d) for d in docs]
    )
    score, rerank, top1, embed, bad = _app_call(
        cross_encoder_dir,
        [
            ("/score", {"model": "m", "text_1": "what is a river", "text_2": docs}),
            ("/rerank", {"model": "m", "query": "what is a river", "documents": docs}),
            ("/v1/rerank", {"query": "what is a river", "documents": docs, "top_n": 1}),
            ("/v1/embeddings", {"input": "the sea"}),
            ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
        ],
    )
    assert score.status_code == 200, score.text
    assert [d["score"] for d in score.json()["data"]] == pytest.approx(want.tolist(), abs=1e-5)
    results = rerank.json()["results"]
    assert [r["index"] for r in results] == list(np.argsort(-want))
    assert results[0]["document"]["text"] == docs[int(np.argmax(want))]
    assert [r["index"] for r in top1.json()["results"]] == [int(np.argmax(want))]
    assert rerank.json()["usage"]["total_tokens"] > 0
    assert embed.status_code == 400 and "cross-encoder" in embed.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_pooling_and_matryoshka_dimensions(qwen3_body_dir: Path) -> None:  # noqa: F811
    long = "the cat " * 200  # 402 tokens, over the model's 256
    full, cut, pooled, odd, empty, unknown, kept, zero, over, query = _app_call(
        qwen3_body_dir,
        [
            ("/v1/embeddings", {"input": [TEXTS[0]]}),
            (
                "/v1/embeddings",
                {"input": [TEXTS[0]], "dimensions": 32, "encoding_format": "base64"},
            ),
            ("/pooling", {"input": TEXTS[0]}),
            ("/v1/embeddings", {"input": "x", "dimensions": 20}),
            ("/v1/embeddings", {"input": []}),
            ("/v1/embeddings", {"input": "x", "colour": "red"}),
            # vLLM's truncate_prompt_tokens: -1 keeps what max_model_len holds; 0 and more
            # than max_model_len are 400s naming it.
            ("/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1}),
            ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}),
            ("/pooling", {"input": "x", "truncate_prompt_tokens": 257}),
            ("/rerank", {"query": long, "documents": ["a"]}),
        ],
    )
    vec = torch.tensor(full.json()["data"][0]["embedding"])
    assert vec.shape == (64,) and float(vec.norm()) == pytest.approx(1.0, abs=1e-5)
    raw = base64.b64decode(cut.json()["data"][0]["embedding"])
    short = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
    torch.testing.assert_close(
        short, torch.nn.functional.normalize(vec[:32], dim=0), atol=1e-5, rtol=1e-4
    )
    assert pooled.json()["data"][0]["object"] == "pooling"
    assert pooled.json()["data"][0]["data"] == pytest.approx(vec.tolist(), abs=1e-6)
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "dimensions"
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["message"]
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 256, kept.text
    for bad in (zero, over):
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    assert query.status_code == 400 and query.json()["error"]["param"] == "query", query.text
    assert query.json()["error"]["message"].startswith("query has 402 tokens")


def test_pooling_routes_on_a_generating_server(client: httpx.Client) -> None:
    out = client.post("/v1/embeddings", json={"model": MODEL, "input": "hello"})
    assert out.status_code == 400 and "--runner pooling" in out.json()["error"]["message"]


def test_requests_cut_at_the_shutdown_deadline_answer_503(
    st_bert_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As the completion routes: a JSON 503 saying why, not uvicorn's plain-text 500.
    engine = PoolingEngine.from_config(EngineConfig(model=ModelConfig(model=str(st_bert_dir))))
    app = build_app(engine, ServerConfig(served_model_names=("m",)))
    monkeypatch.setattr(engine, "_take_batch", list)  # every request stays queued
    calls = [
        ("/v1/embeddings", {"input": "a"}),
        ("/pooling", {"input": "a"}),
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/rerank", {"query": "a", "documents": ["b"]}),
    ]

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            app.router.lifespan_context(app),
        ):
            posts = [asyncio.create_task(client.post(p, json=b)) for p, b in calls]
            while engine.num_waiting < 6:  # each request's texts are queued
                await asyncio.sleep(0.01)
            app.state.asyncserve.shutdown_deadline.set()
            replies = await asyncio.wait_for(asyncio.gather(*posts), 30)
            assert engine.num_waiting == 0
            return replies

    for reply in asyncio.run(main()):
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
