"""An fp8 (e4m3) KV cache with per-tensor scales: the Triton store and attention equal their
references on the same fp8 cache, and stay within fp8's precision of a full-precision one."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import attention  # noqa: E402
from asyncserve.kernels.kv_store import store_kv  # noqa: E402
from tests.kernels.paged_batch import make_batch, rel_err  # noqa: E402

FP8 = torch.float8_e4m3fn
Q_LENS = [19, 7, 1, 1, 1]
CTX_LENS = [21, 0, 40, 16, 3]
K_SCALE, V_SCALE = 0.02, 0.05  # values up to ~5 land in e4m3's normal range


def _to_fp8(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return (cache.float() / scale).clamp(-448, 448).to(FP8)  # NaN (unused blocks) stays NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_reads_fp8_cache(
    device: torch.device, dtype: torch.dtype, num_splits: int
) -> None:
    batch = make_batch(Q_LENS, CTX_LENS, 4, 2, 32, 16, dtype, device, seed=num_splits)
    k8, v8 = _to_fp8(batch.key_cache, K_SCALE), _to_fp8(batch.value_cache, V_SCALE)
    args = (batch.query, k8, v8, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)
    config = attention.AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2)
    out = attention.paged_attention(
        *args, 0.125, config, num_splits, k_scale=K_SCALE, v_scale=V_SCALE
    )
    ref = reference.unified_attention(*args, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < (1e-4 if dtype == torch.float32 else 2e-2)
    # Against the unquantized cache: e4m3 keeps 3 mantissa bits.
    full = reference.unified_attention(*batch.args(), 0.125)
    assert rel_err(out, full) < 0.05


def test_unified_attention_passes_the_scales(device: torch.device) -> None:
    batch = make_batch([1, 1], [30, 5], 2, 1, 32, 16, torch.float32, device, seed=9)
    k8, v8 = _to_fp8(batch.key_cache, K_SCALE), _to_fp8(batch.value_cache, V_SCALE)
    args = (batch.query, k8, v8, batch.cu_seqlens_q, batch.seq_lens, batch.block_tables)
    out = attention.unified_attention(*args, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = reference.unified_attention(*args, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-4


def test_store_kv_fp8_matches_reference(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim, tokens = 4, 16, 2, 32, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[5] = -1
    key = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(device)
    value = (torch.randn(tokens, heads, dim, generator=gen) * 20).to(device)
    key[0, 0, 0] = 1e6  # saturates at 448 * scale instead of overflowing to NaN
    caches = [
        torch.zeros(num_blocks, block_size, heads, dim, dtype=FP8, device=device) for _ in range(4)
    ]
    store_kv(key, value, caches[0], caches[1], slots.to(device), K_SCALE, V_SCALE)
    reference.store_kv(key, value, caches[2], caches[3], slots.to(device), K_SCALE, V_SCALE)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        got, want = ours.float(), ref.float()
        assert not got.isnan().any() and got.abs().max() == 448
        if device.type == "cuda":
            assert torch.equal(got, want)
        else:
            # Triton's interpreter drops the carry into the next binade (see test_fp8_gemm).
            carry = (want.abs().log2() == want.abs().log2().round()) & (got == want / 2)
            assert ((got == want) | carry).all()
