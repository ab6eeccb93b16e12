"""LoRA runtime endpoints under hostile use (in-process ASGI, tiny Llama): folders that are
not adapters, concurrent loads of one name, unloading an adapter in use, an adapter folder
removed after its load; each is a 400/404 or a finished request, and the server goes on."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from asyncserve.config import ServerConfig
from asyncserve.http.app import build_app
from tests.lora.conftest import TinyLoRA, edit_config, hf_greedy
from tests.lora.test_lora_http import AUTH, KEY, PROMPT, _engine, _ids

pytestmark = pytest.mark.timeout(300)


@asynccontextmanager
async def _client(tiny_lora: TinyLoRA) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    engine = _engine(tiny_lora)
    config = ServerConfig(served_model_names=("base",), api_key=KEY,
                          allow_runtime_lora_updating=True)  # fmt: skip
    app = build_app(engine, config)
    transport = httpx.ASGITransport(app=app)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://app", timeout=120) as client,
        app.router.lifespan_context(app),
    ):
        yield client, engine


async def _load(
    client: httpx.AsyncClient, name: str, path: object, **extra: object
) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path), **extra}
    return await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)


async def _complete(client: httpx.AsyncClient, model: str, n: int) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    return await client.post("/v1/completions", json=body, headers=AUTH)


def test_folders_that_are_not_adapters(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    a = tiny_lora.adapters[0].path
    (tmp_path / "empty").mkdir()
    garbage = edit_config(a, tmp_path / "garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    truncated = edit_config(a, tmp_path / "truncated")
    data = (a / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    listed = edit_config(a, tmp_path / "listed")
    (listed / "adapter_config.json").write_text("[1, 2]")
    deep = edit_config(a, tmp_path / "deep")
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    cases = [
        (tiny_lora.base_path, "adapter_config.json not found"),  # a model, not an adapter
        (tmp_path / "empty", "adapter_config.json not found"),
        (a / "adapter_config.json", "not a directory"),
        (garbage, "cannot be read"),
        (truncated, "adapter_model.safetensors"),
        (listed, "must hold a JSON object"),
        (deep, "nested too deeply"),
        (tmp_path / ("x" * 300), "not a directory"),  # a name too long for the file system
        (edit_config(a, tmp_path / "rank", r=17), "exceeds max_lora_rank=16"),
        (edit_config(a, tmp_path / "rank0", r=0), "r (rank) must be a positive integer"),
        (edit_config(a, tmp_path / "srank", r="8"), "r (rank) must be a positive integer"),
        (edit_config(a, tmp_path / "targets", target_modules=[1]), "target_modules"),
        (edit_config(a, tmp_path / "alpha", lora_alpha="x"), "lora_alpha"),
    ]

    async def main() -> None:
        async with _client(tiny_lora) as (client, _):
            for path, words in cases:
                reply = await _load(client, "bad", path)
                assert reply.status_code == 400, (path, reply.text)
                error = reply.json()["error"]
                assert words in error["message"] and error["param"] == "lora_path", error
            for body in ({"lora_name": "x", "lora_path": 5}, {"lora_name": ["x"], "lora_path": "p"},
                         {"lora_name": "", "lora_path": str(a)}, {"lora_name": "base", "lora_path": str(a)}):  # fmt: skip
                reply = await client.post("/v1/load_lora_adapter", json=body, headers=AUTH)
                assert reply.status_code == 400, (body, reply.text)
            unload = await client.post(
                "/v1/unload_lora_adapter", json={"lora_name": 5}, headers=AUTH
            )
            assert unload.status_code == 400
            assert _ids(await _complete(client, "base", 4)) == hf_greedy(tiny_lora.base, PROMPT, 4)

    asyncio.run(main())


def test_concurrent_loads_of_one_name(tiny_lora: TinyLoRA) -> None:
    a, b, _ = tiny_lora.adapters

    async def main() -> None:
        async with _client(tiny_lora) as (client, _):
            replies = await asyncio.gather(*(_load(client, "same", p.path) for p in (a, b) * 4))
            codes = sorted(r.status_code for r in replies)
            assert codes == [200] + [400] * 7, [r.text for r in replies]
            models = (await client.get("/v1/models", headers=AUTH)).json()["data"]
            assert [m["id"] for m in models] == ["base", "same"]
            winner = next(r for r in replies if r.status_code == 200)
            path = models[1]["root"]
            expected = a if path == str(a.path) else b
            assert _ids(await _complete(client, "same", 4)) == hf_greedy(expected.model, PROMPT, 4)
            # In place, concurrently: every load succeeds and one of them is what runs.
            replies = await asyncio.gather(
                *(_load(client, "same", p.path, load_inplace=True) for p in (a, b) * 2)
            )
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            assert winner.status_code == 200

    asyncio.run(main())


def test_unload_while_in_use_and_folder_removed(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    a = tiny_lora.adapters[0]
    copy = edit_config(a.path, tmp_path / "copy")
    gone = edit_config(a.path, tmp_path / "gone")
    n = 40

    async def main() -> None:
        async with _client(tiny_lora) as (client, engine):
            assert (await _load(client, "ad", copy)).status_code == 200
            running = asyncio.create_task(_complete(client, "ad", n))
            # Wait until the worker holds the adapter's weights: a read after the folder is
            # gone fails the request instead (tests/lora/test_lora_unreadable.py).
            slots = engine.executor.runner.lora  # type: ignore[attr-defined]
            while not slots.loaded_ids:
                await asyncio.sleep(0.001)
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ad"},
                                       headers=AUTH)  # fmt: skip
            assert unload.status_code == 200
            shutil.rmtree(copy)
            assert _ids(await running) == hf_greedy(a.model, PROMPT, n)
            # The folder of a loaded adapter removed before its first use: requests for it
            # are 400s (the runner would read it on first use); the server goes on.
            assert (await _load(client, "gone", gone)).status_code == 200
            shutil.rmtree(gone)
            failed = await _complete(client, "gone", 4)
            assert failed.status_code == 400, failed.text
            assert "is gone from" in failed.json()["error"]["message"]
            assert _ids(await _complete(client, "base", 4)) == hf_greedy(tiny_lora.base, PROMPT, 4)
            health = await client.get("/health")
            assert health.status_code == 200

    asyncio.run(main())
