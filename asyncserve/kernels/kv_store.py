"""Triton write of this step's K/V into their slots of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = skip
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # pow2 >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # pow2 >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    k_scale,  # fp8 caches: the stored value is k / k_scale
    v_scale,
    FP8: tl.constexpr,  # the caches are e4m3
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    k = tl.load(
        key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
        mask=mask,
    )
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    k_dst = block_id * stride_kc_block + offset * stride_kc_slot
    v_dst = block_id * stride_vc_block + offset * stride_vc_slot
    tl.store(
        key_cache_ptr + k_dst + heads[:, None] * stride_kc_head + dims[None, :],
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + v_dst + heads[:, None] * stride_vc_head + dims[None, :],
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its slot of the paged cache (slot -1: skip the token);
    an fp8 cache stores value / scale."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_heads, cache_dim = key_cache.shape
    if (cache_heads, cache_dim) != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit a cache of "
            f"{tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError("key_cache and value_cache must have the same shape")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache need a contiguous last dimension")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,  # [T, Hkv, D]
        value,  # [T, Hkv, D]
        key_cache,  # [num_blocks, block_size, Hkv, D]
        value_cache,  # [num_blocks, block_size, Hkv, D]
        slot_mapping,  # [T]
        key.stride(0),  # stride_k_tok
        key.stride(1),  # stride_k_head
        value.stride(0),  # stride_v_tok
        value.stride(1),  # stride_v_head
        key_cache.stride(0),  # stride_kc_block (may exceed 2**31)
        key_cache.stride(1),  # stride_kc_slot
        key_cache.stride(2),  # stride_kc_head
        value_cache.stride(0),  # stride_vc_block
        value_cache.stride(1),  # stride_vc_slot
        value_cache.stride(2),  # stride_vc_head
        NUM_KV_HEADS=num_kv_heads,  # Hkv
        HEAD_DIM=head_dim,  # D
        BLOCK_H=block_h,  # pow2 >= Hkv
        BLOCK_D=block_d,  # pow2 >= D
        BLOCK_SIZE=block_size,  # tokens per cache block
        k_scale=k_scale,
        v_scale=v_scale,
        FP8=key_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
