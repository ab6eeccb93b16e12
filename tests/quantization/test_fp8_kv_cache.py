"""`--kv-cache-dtype fp8`: the pool stores e4m3 (one byte a value: twice the tokens of bf16,
four times fp32's) and attention reads it back through its per-tensor scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve.config import CacheConfig
from asyncserve.llm import LLM
from asyncserve.outputs import RequestOutput
from asyncserve.worker.kv_pool import kv_block_bytes, kv_cache_dtype
from tests.quantization.conftest import greedy_agreement

BUDGET = 16 << 20


@pytest.fixture(scope="module")
def fp8_kv_llm(gguf_path: Path):  # type: ignore[no-untyped-def]
    llm = LLM(str(gguf_path), device="cpu", max_model_len=256, kv_cache_memory=BUDGET,
              kv_cache_dtype="fp8")  # fmt: skip
    yield llm
    llm.close()


def test_pool_holds_fp8(fp8_kv_llm: LLM) -> None:
    arch = fp8_kv_llm.engine.loaded.arch
    runner = fp8_kv_llm.engine.runner
    assert runner is not None
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    fp8_bytes = kv_block_bytes(arch, 16, torch.float8_e4m3fn)
    assert 2 * fp8_bytes == kv_block_bytes(arch, 16, torch.bfloat16)
    assert fp8_kv_llm.engine.num_blocks == BUDGET // fp8_bytes  # 4x an fp32 pool's blocks
    # Weights and activations keep the model's dtype.
    assert next(fp8_kv_llm.engine.loaded.model.parameters()).dtype == torch.float32


def test_greedy_agreement_with_full_precision_cache(
    fp8_kv_llm: LLM, greedy_reference: list[RequestOutput]
) -> None:
    # Measured 245 of 256 (95.7%) with scales of 1.0.
    agree, total = greedy_agreement(fp8_kv_llm, greedy_reference)
    assert agree / total >= 0.9, f"{agree}/{total} positions agree"


def test_kv_cache_dtype_values() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert kv_cache_dtype("fp8_e4m3", torch.float32, torch.device("cpu")) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3"):
        CacheConfig(cache_dtype="fp8_e5m2")
