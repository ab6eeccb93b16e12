"""LoRA with data parallelism (two replica processes of the tiny Llama on CPU): a batch
mixing adapters and the base equals transformers+peft greedy, token for token, over both
replicas; adapters registered, loaded and unloaded (offline and over HTTP) reach every
replica; a bad adapter is refused in the front end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncserve import LLM, SamplingParams
from asyncserve.config import ServerConfig
from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.engine.dp_metrics import DataParallelMetrics
from asyncserve.http.app import build_app
from asyncserve.lora.request import LoRARequest
from tests.http.conftest import ServerProcess
from tests.lora.conftest import TinyLoRA, edit_config, hf_greedy

pytestmark = pytest.mark.timeout(300)
NUM_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
KEY = "dp-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def dp_llm(tiny_lora: TinyLoRA) -> Iterator[LLM]:
    llm = LLM(
        str(tiny_lora.base_path),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory=4 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        data_parallel_size=2,
    )
    yield llm
    llm.close()


def _client(llm: LLM) -> DataParallelClient:
    assert isinstance(llm.engine, DataParallelClient)
    return llm.engine


def test_mixed_batch_over_two_replicas_matches_peft(dp_llm: LLM, tiny_lora: TinyLoRA) -> None:
    a, b, c = tiny_lora.adapters
    req_a, req_b, req_c = (
        LoRARequest(name, i + 1, str(ad.path))
        for i, (name, ad) in enumerate(zip("abc", (a, b, c), strict=True))
    )
    prompts = [[11, 42, 7, 99], [5, 6, 7, 8, 9], [300, 2, 17], [1, 2, 3, 4, 5, 6], [40, 41], [9, 8]]
    loras = [req_a, req_b, req_c, None, req_a, req_b]
    refs = [a.model, b.model, c.model, tiny_lora.base, a.model, b.model]
    client = _client(dp_llm)
    client.balancer.lora_affinity_tokens = -1  # spread this one batch over both replicas
    got = dp_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    expected = [hf_greedy(ref, p, NUM_TOKENS) for ref, p in zip(refs, prompts, strict=True)]
    assert [list(o.outputs[0].token_ids) for o in got] == expected
    assert all(n > 0 for n in client.balancer.num_chosen), client.balancer.num_chosen
    assert sorted(dp_llm.list_loras()) == [1, 2, 3]


def test_add_and_remove_reach_every_replica(
    dp_llm: LLM, tiny_lora: TinyLoRA, tmp_path: Path
) -> None:
    client = _client(dp_llm)
    a = tiny_lora.adapters[0]
    assert dp_llm.add_lora(LoRARequest("x", 10, str(a.path))) is True
    assert all(10 in ids for ids in client.lora.replica_loras), client.lora.replica_loras
    assert dp_llm.add_lora(LoRARequest("x", 10, str(a.path))) is False
    assert dp_llm.remove_lora(10) is True
    assert all(10 not in ids for ids in client.lora.replica_loras), client.lora.replica_loras
    assert dp_llm.remove_lora(10) is False
    bad = edit_config(a.path, tmp_path / "bad", r=64)
    with pytest.raises(ValueError, match="rank"):
        dp_llm.add_lora(LoRARequest("bad", 11, str(bad)))
    assert 11 not in dp_llm.list_loras()


def test_serve_dp2_with_lora_modules(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """`serve -dp 2 --enable-lora --lora-modules`: the adapter is listed and answers by
    name; a bad one stops the start with one line and status 2."""
    a, _, c = tiny_lora.adapters
    common = [str(tiny_lora.base_path), "--device", "cpu", "--dtype", "float32", "-dp", "2",
              "--kv-cache-memory", "4M", "--served-model-name", "base", "--enable-lora",
              "--max-lora-rank", "8"]  # fmt: skip
    server = ServerProcess([*common, "--lora-modules", f"ad-a={a.path}"], tmp_path)
    try:
        server.wait_ready()
        models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("ad-a", "base")]
        body = {"model": "ad-a", "prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "n": 2}  # fmt: skip
        out = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        expected = hf_greedy(a.model, [5, 9, 13], 4)
        assert [ch["token_ids"] for ch in out["choices"]] == [expected, expected]
    finally:
        assert server.stop() == 0
    bad = ServerProcess([*common, "--lora-modules", f"c={c.path}"], tmp_path)  # rank 16 > 8
    assert bad.proc.wait(120) == 2
    bad.stop()
    assert "max_lora_rank=8" in bad.logs() and "Traceback" not in bad.logs()


def test_load_unload_over_http_on_two_replicas(dp_llm: LLM, tiny_lora: TinyLoRA) -> None:
    """Last in the module: the server's shutdown ends the replicas."""
    client = _client(dp_llm)
    for lora_id in dp_llm.list_loras():  # the server hands out ids from 1
        dp_llm.remove_lora(lora_id)
    a, b, _ = tiny_lora.adapters
    config = ServerConfig(
        served_model_names=("base",),
        api_key=KEY,
        lora_modules=(("ad-a", str(a.path)),),
        allow_runtime_lora_updating=True,
    )
    app = build_app(client, config, DataParallelMetrics())
    prompt = [11, 42, 7, 99, 250, 3, 18]

    async def complete(http: httpx.AsyncClient, model: str) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = await http.post("/v1/completions", json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as http,
            app.router.lifespan_context(app),
        ):
            models = (await http.get("/v1/models", headers=AUTH)).json()["data"]
            assert ("ad-a", "base") in [(m["id"], m["parent"]) for m in models]
            assert await complete(http, "ad-a") == hf_greedy(a.model, prompt, NUM_TOKENS)
            load = {"lora_name": "ad-b", "lora_path": str(b.path)}
            r = await http.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert r.status_code == 200, r.text
            new_id = max(client.lora.loras)
            assert all(new_id in ids for ids in client.lora.replica_loras), (
                client.lora.replica_loras
            )
            assert await complete(http, "ad-b") == hf_greedy(b.model, prompt, NUM_TOKENS)
            bad = {"lora_name": "ad-bad", "lora_path": str(b.path) + "-missing"}
            r = await http.post("/v1/load_lora_adapter", json=bad, headers=AUTH)
            assert r.status_code == 400, r.text
            r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "ad-b"}, headers=AUTH)
            assert r.status_code == 200, r.text
            assert all(new_id not in ids for ids in client.lora.replica_loras), (
                client.lora.replica_loras
            )
            assert await complete(http, "base") == hf_greedy(tiny_lora.base, prompt, NUM_TOKENS)

    dp_llm._loop.run_until_complete(main())
