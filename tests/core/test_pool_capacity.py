"""A KV pool too small for one max_model_len request: refused at start-up when max_model_len
was asked for, the model's own length lowered to what the pool holds otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asyncserve.core.pool_capacity import blocks_needed, fit_max_model_len
from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams


def test_blocks_needed_full_and_sliding_attention() -> None:
    assert blocks_needed(33, 16, None, 64) == 3
    # A window: the window, one step's tokens and a partial block at each end, at most.
    assert blocks_needed(10_000, 16, 128, 64) == (128 + 64 + 32) // 16
    assert blocks_needed(40, 16, 128, 64) == 3


def _config(asked: int | None) -> EngineConfig:
    """Blocks of 16 tokens, steps of 64; max_model_len as the user gave it (None: unset)."""
    return EngineConfig(
        model=ModelConfig(max_model_len=asked),
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    )


def test_fit_keeps_a_length_the_pool_holds() -> None:
    assert fit_max_model_len(256, _config(256), 16, None) == 256


def test_fit_refuses_an_asked_length_naming_what_fits() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 257 .* <= 256"):
        fit_max_model_len(257, _config(257), 16, None)


def test_fit_lowers_the_models_own_length(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert fit_max_model_len(8192, _config(None), 16, None) == 256
    assert "max_model_len is 256" in caplog.text
    # Sliding windows hold a bounded span: any length fits a pool that holds it.
    assert fit_max_model_len(8192, _config(8192), 16, 128) == 8192


def test_engine_start(gguf_path: Path) -> None:
    # 4 MiB hold 5 blocks of 16 SmolLM2 tokens in fp32 (46,080 bytes a token).
    small = {"device": "cpu", "kv_cache_memory": 4 << 20}
    with pytest.raises(ValueError, match="max_model_len 256 is more than the KV cache holds"):
        LLM(str(gguf_path), max_model_len=256, **small)
    llm = LLM(str(gguf_path), **small)
    try:
        assert llm.engine.max_model_len == 80
        params = SamplingParams(max_tokens=4, temperature=0.0)
        long, short = llm.generate(
            [{"prompt_token_ids": [1] * 100}, {"prompt_token_ids": [1] * 60}], params,
            use_tqdm=False,
        )  # fmt: skip
        assert long.outputs[0].finish_reason == "error"
        assert "max_model_len is 80" in str(long.error)
        assert len(short.outputs[0].token_ids) == 4
    finally:
        llm.close()
