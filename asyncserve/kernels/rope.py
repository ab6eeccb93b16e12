"""Triton NeoX-style (rotate-half) rotary embedding, applied in place to query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, heads, D] of one token: base pointer already at the token
    stride_head,
    num_heads,
    cos,  # [BLOCK_HALF] fp32
    sin,  # [BLOCK_HALF] fp32
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    ptr1 = x_ptr + heads[:, None] * stride_head + dims[None, :]
    ptr2 = ptr1 + half
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, out2.to(x_ptr.dtype.element_ty), mask=mask)


# A step's positions may start anywhere in their buffer (a micro-batch's second half): one
# compiled kernel whatever their alignment (each position is loaded on its own).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr"])
def _rotary_kernel(
    positions_ptr,  # [T]
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, Hkv, D]
    cos_sin_ptr,  # [max_position, 2 * half]: cos then sin
    num_heads,
    num_kv_heads,
    half,  # rotary_dim // 2
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cs_pos,
    BLOCK_H: tl.constexpr,  # pow2 >= max(H, Hkv)
    BLOCK_HALF: tl.constexpr,  # pow2 >= half
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cs_row = cos_sin_ptr + pos * stride_cs_pos
    cos = tl.load(cs_row + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr + tok * stride_q_tok,
        stride_q_head,
        num_heads,
        cos,
        sin,
        half,
        BLOCK_H,
        BLOCK_HALF,
    )
    _rotate_heads(
        key_ptr + tok * stride_k_tok,
        stride_k_head,
        num_kv_heads,
        cos,
        sin,
        half,
        BLOCK_H,
        BLOCK_HALF,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first rotary_dim dims of every head of query and key, in place.

    Same result as reference.rotary_embedding (cos_sin_cache [max_position, rotary_dim],
    cos in the first half); query and key are modified and returned. Dims past rotary_dim
    are left as they are.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, key_dim = key.shape
    rotary_dim = cos_sin_cache.shape[-1]
    if key.shape[0] != num_tokens or key_dim != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("query, key and cos_sin_cache need a contiguous last dimension")
    if num_tokens == 0:
        return query, key
    half = rotary_dim // 2
    block_h = triton.next_power_of_2(max(num_heads, num_kv_heads))
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        positions,  # [T]
        query,  # [T, H, D]
        key,  # [T, Hkv, D]
        cos_sin_cache,  # [max_position, rotary_dim]
        num_heads,  # H
        num_kv_heads,  # Hkv
        half,  # rotary_dim // 2
        query.stride(0),  # stride_q_tok
        query.stride(1),  # stride_q_head
        key.stride(0),  # stride_k_tok
        key.stride(1),  # stride_k_head
        cos_sin_cache.stride(0),  # stride_cs_pos
        BLOCK_H=block_h,  # pow2 >= max(H, Hkv)
        BLOCK_HALF=block_half,  # pow2 >= half
        num_warps=4 if block_h * block_half >= 1024 else 1,
    )
    return query, key
