"""`--kv-cache-dtype fp8`: the pool stores e4m3 (one byte a value: twice the tokens of bf16,
four times fp32's) and attention reads it back through its per-tensor scales."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncserve.config import CacheConfig, ModelConfig
from asyncserve.llm import LLM
from asyncserve.models.loader import load_model
from asyncserve.outputs import RequestOutput
from asyncserve.worker.kv_pool import kv_block_bytes, kv_cache_dtype
from tests.models.conftest import new_kv_caches, paged_step
from tests.quantization.conftest import greedy_agreement
from tests.quantization.test_fp8_checkpoints import FIXTURES, IDS, read_tensors

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


def test_kv_scales_from_the_checkpoint(tmp_path: Path) -> None:
    """compressed-tensors names (self_attn.k_scale / v_scale) and the older single kv_scale;
    the model then runs on fp8 caches within fp8's precision of fp32 ones."""
    src = FIXTURES / "llama-bf16"
    tensors = read_tensors(src)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.125)
    root = tmp_path / "m"
    root.mkdir()
    shutil.copy(src / "config.json", root / "config.json")
    save_file(tensors, str(root / "model.safetensors"))
    model = load_model(ModelConfig(model=str(root), dtype="float32"), torch.device("cpu")).model
    attn = [layer.self_attn.attn for layer in model.model.layers]
    assert (attn[0].k_scale, attn[0].v_scale, attn[1].k_scale, attn[1].v_scale) == (
        0.5,
        0.25,
        0.125,
        0.125,
    )
    fp32_caches = new_kv_caches(model, 4)
    full = paged_step(model, fp32_caches, [(IDS, 0, [0, 1, 2])])[0]
    fp8_caches = [
        (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in new_kv_caches(model, 4)
    ]
    fp8 = paged_step(model, fp8_caches, [(IDS, 0, [0, 1, 2])])[0]
    # The caches hold value / scale: times the layer's scale, within e4m3's rounding of the
    # full-precision cache (layer 1's inputs already differ a little).
    for layer, (scale, tol) in enumerate([(0.5, 2**-4), (0.125, 0.25)]):
        stored = fp8_caches[layer][0][:3].float() * scale
        want = fp32_caches[layer][0][:3]
        assert ((stored - want).norm() / want.norm()).item() < tol / 2
    # The random model's small logits move by a few percent of their norm.
    assert ((fp8 - full).norm() / full.norm()).item() < 0.08
