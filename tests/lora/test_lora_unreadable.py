"""An adapter whose files go away (or are corrupted) after it was loaded fails only the
requests that use it: the runner runs their rows without it and voids their outputs, the
engine ends them with the reason, refuses the adapter at admission until it is loaded again,
and keeps serving the base model and the other adapters."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncserve import LoRARequest, SamplingParams
from asyncserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ServerConfig,
)
from asyncserve.core.step import StepResult, driver_result
from asyncserve.http.app import build_app
from asyncserve.outputs import RequestOutput
from tests.lora.conftest import TinyLoRA, hf_greedy

pytestmark = pytest.mark.timeout(300)
KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 42, 7, 99, 250, 3, 18]
NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _engine(tiny_lora: TinyLoRA, tensor_parallel_size: int = 1) -> Any:
    from asyncserve.engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model=str(tiny_lora.base_path), dtype="float32", device="cpu"),
            cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4),
            lora=LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        )
    )


async def _final(stream: Any) -> RequestOutput:
    while True:
        output: RequestOutput = await stream.get()
        if output.finished:
            return output


async def _deleted_after_admission(engine: Any, tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """Requests for the base, adapter b and a copy of adapter a are admitted; the copy's
    folder is deleted before the runner first reads it."""
    a, b, _ = tiny_lora.adapters
    copy = tmp_path / "a-copy"
    shutil.copytree(a.path, copy)
    gone = LoRARequest("a-copy", 7, str(copy))
    other = LoRARequest("b", 2, str(b.path))
    await engine.start()
    streams = [
        engine.add_request(PROMPT, GREEDY, "base"),
        engine.add_request(PROMPT, GREEDY, "gone", lora_request=gone),
        engine.add_request(PROMPT, GREEDY, "other", lora_request=other),
    ]
    shutil.rmtree(copy)  # before the step loop runs: admission has passed
    base_out, gone_out, other_out = [await _final(s) for s in streams]

    assert gone_out.outputs[0].finish_reason == "error"
    assert gone_out.error is not None and "'a-copy' could not be read" in gone_out.error
    assert base_out.outputs[0].token_ids == hf_greedy(tiny_lora.base, PROMPT, NUM_TOKENS)
    assert other_out.outputs[0].token_ids == hf_greedy(b.model, PROMPT, NUM_TOKENS)
    assert engine.is_running

    # Refused at admission until loaded again.
    with pytest.raises(ValueError, match="'a-copy' could not be read"):
        engine.add_request(PROMPT, GREEDY, "again", lora_request=gone)
    # Loading it again while it is still unreadable says so.
    with pytest.raises(ValueError, match="could not be read.*loading it again failed"):
        engine.add_lora(gone)
    # The engine keeps serving.
    after = await _final(engine.add_request(PROMPT, GREEDY, "after"))
    assert after.outputs[0].token_ids == hf_greedy(tiny_lora.base, PROMPT, NUM_TOKENS)

    # Restored and loaded again: it runs, with its own weights (not the base's K/V).
    shutil.copytree(a.path, copy)
    assert engine.add_lora(gone)
    back = await _final(engine.add_request(PROMPT, GREEDY, "back", lora_request=gone))
    assert back.outputs[0].token_ids == hf_greedy(a.model, PROMPT, NUM_TOKENS)


def test_deleted_adapter_fails_only_its_requests(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    engine = _engine(tiny_lora)

    async def main() -> None:
        try:
            await _deleted_after_admission(engine, tiny_lora, tmp_path)
        finally:
            await engine.close()

    asyncio.run(main())


def test_deleted_adapter_under_tensor_parallel(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """TP=2 (gloo): every rank runs the rows without the adapter, collectives included."""
    engine = _engine(tiny_lora, tensor_parallel_size=2)

    async def main() -> None:
        try:
            await _deleted_after_admission(engine, tiny_lora, tmp_path)
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_failure_on_any_rank_fails_the_request() -> None:
    driver = StepResult(sampled_token_ids={"r1": [5], "r2": [6]})
    replies: list[Any] = [None, driver, {"r2": "LoRA adapter 'x' could not be read: gone"}]
    result = driver_result(replies, 1)
    assert result is driver
    assert result.failed_requests == {"r2": "LoRA adapter 'x' could not be read: gone"}
    # The driver's own reason wins over another rank's for the same request.
    driver.failed_requests["r2"] = "driver's reason"
    assert driver_result(replies, 1).failed_requests == {"r2": "driver's reason"}


def test_corrupted_adapter_over_http(tiny_lora: TinyLoRA, tmp_path: Path) -> None:
    """Startup adapters are read by the runner on first use: one corrupted before that
    fails its requests with a 400 naming it; base and the other adapter answer alongside."""
    a, b, _ = tiny_lora.adapters
    copy = tmp_path / "a-copy"
    shutil.copytree(a.path, copy)
    engine = _engine(tiny_lora)
    config = ServerConfig(
        served_model_names=("base",),
        api_key=KEY,
        lora_modules=(("ad-x", str(copy)), ("ad-b", str(b.path))),
        allow_runtime_lora_updating=True,
    )
    app = build_app(engine, config)
    weights = copy / "adapter_model.safetensors"
    weights.write_bytes(b"\x00" * 64)  # still a file: only reading it fails

    async def complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        return await client.post("/v1/completions", json=body, headers=AUTH)

    def ids(response: httpx.Response) -> list[int]:
        assert response.status_code == 200, response.text
        return list(response.json()["choices"][0]["token_ids"] or [])

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            app.router.lifespan_context(app),
        ):
            base, bad, other = await asyncio.gather(
                complete(client, "base"), complete(client, "ad-x"), complete(client, "ad-b")
            )
            assert bad.status_code == 400, bad.text
            assert "'ad-x' could not be read" in bad.json()["error"]["message"]
            assert ids(base) == hf_greedy(tiny_lora.base, PROMPT, NUM_TOKENS)
            assert ids(other) == hf_greedy(b.model, PROMPT, NUM_TOKENS)

            # Refused at admission now, naming the field; the server goes on.
            again = await complete(client, "ad-x")
            assert again.status_code == 400 and again.json()["error"]["param"] == "model"
            assert "'ad-x' could not be read" in again.json()["error"]["message"]
            assert ids(await complete(client, "ad-b")) == hf_greedy(b.model, PROMPT, NUM_TOKENS)

            # Restored and loaded again in place: it serves its own outputs.
            weights.write_bytes((a.path / "adapter_model.safetensors").read_bytes())
            load = {"lora_name": "ad-x", "lora_path": str(copy), "load_inplace": True}
            loaded = await client.post("/v1/load_lora_adapter", json=load, headers=AUTH)
            assert loaded.status_code == 200, loaded.text
            assert ids(await complete(client, "ad-x")) == hf_greedy(a.model, PROMPT, NUM_TOKENS)

    asyncio.run(main())
