"""store_kv (Triton) writes the same cache as reference.store_kv."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.kv_store import store_kv  # noqa: E402


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype", "num_kv_heads", "head_dim"),
    [
        (torch.float32, torch.float32, 2, 64),
        (torch.bfloat16, torch.bfloat16, 3, 32),  # head count not a power of 2
        (torch.float32, torch.bfloat16, 1, 48),  # cast on store, head dim not a power of 2
    ],
)
def test_store_kv_matches_reference(
    device: torch.device,
    bf16_rtne: bool,
    src_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_tokens = 6, 16, 21
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens
    slot_mapping = slots.to(device)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(src_dtype).to(device)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(src_dtype)
    value = value.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    before_k, before_v = key_cache.clone(), value_cache.clone()

    reference.store_kv(key, value, ref_k, ref_v, slot_mapping)
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    if src_dtype == cache_dtype or bf16_rtne:
        assert torch.equal(key_cache, ref_k)
        assert torch.equal(value_cache, ref_v)
    else:  # the interpreter's fp32 -> bf16 cast truncates: within one unit, toward zero
        torch.testing.assert_close(key_cache, ref_k, atol=0, rtol=1e-2)
        torch.testing.assert_close(value_cache, ref_v, atol=0, rtol=1e-2)
    # Slots not in the mapping (and those of the -1 tokens) keep their old contents.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slot_mapping[slot_mapping >= 0]] = False
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    assert torch.equal(key_cache.view(flat)[untouched], before_k.view(flat)[untouched])
    assert torch.equal(value_cache.view(flat)[untouched], before_v.view(flat)[untouched])


def test_store_kv_strided_source(device: torch.device) -> None:
    """K and V sliced out of one fused qkv projection (non-contiguous token stride)."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn((9, 8, 32), generator=gen).to(device)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slot_mapping = torch.tensor([5, 0, 31, -1, 17, 2, 9, 30, 16], device=device)
    key_cache = torch.zeros((2, 16, 2, 32), device=device)
    value_cache = torch.zeros_like(key_cache)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.store_kv(key, value, ref_k, ref_v, slot_mapping)
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, ref_k)
    assert torch.equal(value_cache, ref_v)


def test_store_kv_rejects_mismatched_cache(device: torch.device) -> None:
    key = torch.zeros((2, 2, 32), device=device)
    cache = torch.zeros((1, 16, 4, 32), device=device)
    with pytest.raises(ValueError, match="do not fit"):
        store_kv(key, key, cache, cache, torch.zeros(2, dtype=torch.int64, device=device))
