"""Issue 23 item 7: a long prompt does not stall the streams beside it on a slow device.

On CPU a long prompt that fits one step of max_num_batched_tokens holds a running stream
for its whole prefill: with no target (0) the stream's longest gap is the prefill. With a
decode-latency target the engine learns its step time per token and prefills the prompt in
chunks that keep each step near the target, so the longest gap is a fraction of the
prefill. The target is set from the prefill time measured here, so the test means the same
on a fast machine and a slow one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.config import EngineConfig
from asyncserve.engine.async_engine import AsyncEngine

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

PROMPT_LEN = 1200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose long prefill takes a while on CPU."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("latency_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


async def _stream_beside_long_prompt(engine: AsyncEngine) -> tuple[list[float], float, float]:
    """Arrival times of a stream's tokens, and when the long prompt was added and answered."""
    arrivals: list[float] = []
    started = asyncio.Event()
    done = asyncio.Event()

    async def stream() -> None:
        params = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
        async for _ in engine.generate([5, 6, 7, 8], params, "stream"):
            arrivals.append(time.monotonic())
            if len(arrivals) == 8:
                started.set()
            if done.is_set():
                break

    task = asyncio.create_task(stream())
    await started.wait()
    added = time.monotonic()
    prompt = [int(t) for t in torch.randint(3, 320, (PROMPT_LEN,))]
    async for _ in engine.generate(prompt, SamplingParams(max_tokens=1), "long"):
        pass
    answered = time.monotonic()
    done.set()
    await task
    return arrivals, added, answered


def _run(model_dir: Path, target_ms: float) -> tuple[float, list[float]]:
    """The long prompt's prefill time and the stream's gaps during it."""
    config = EngineConfig.from_engine_args(
        str(model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=4096,
        max_num_batched_tokens=2048,
        kv_cache_memory=64 << 20,
        enforce_eager=True,
        decode_latency_target_ms=target_ms,
    )
    engine = AsyncEngine.from_config(config)

    async def main() -> tuple[list[float], float, float]:
        try:
            return await _stream_beside_long_prompt(engine)
        finally:
            await engine.close()

    arrivals, added, answered = asyncio.run(main())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if added < b <= answered]
    return answered - added, gaps


def test_stream_gap_beside_a_long_prompt_is_bounded(model_dir: Path) -> None:
    # No target: the prompt is one step, and the stream waits for all of it.
    prefill, gaps = _run(model_dir, target_ms=0.0)
    assert max(gaps) > prefill / 2, f"longest gap {max(gaps):.3f} s, prefill {prefill:.3f} s"
    # A target of a tenth of that prefill: the stream keeps flowing through it.
    target_ms = max(prefill * 100, 10.0)
    capped_prefill, gaps = _run(model_dir, target_ms)
    assert len(gaps) >= 4, f"{len(gaps)} stream tokens during a {capped_prefill:.2f} s prefill"
    longest = max(gaps)
    assert longest < prefill / 3, f"longest gap {longest:.3f} s, uncapped prefill {prefill:.3f} s"
