"""Triton rotary embedding fused with the KV store (and Qwen3's / Gemma 3's per-head q/k
RMSNorm before it): one launch per layer instead of up to four (q norm, k norm, rotary, store).

At decode each of those kernels moves a few KiB, so a layer paid their launches, not their
bytes: Qwen3-0.6B at 24 sequences spends ~2 ms a step on the device for ~1 ms of reads.
Per token, one program: the query heads are normed and rotated in place (the attention reads
them next); the key heads are normed, rotated and written with the value heads straight into
their slot of the paged cache (the key rows of the projection output are left as they were:
only the cache is read after this).

Numerics are those of kernels/norm.py and kernels/rope.py run one after the other: the norm
rounds its output to the activations' dtype, and rotary reads that back in fp32.
Reference: reference.rope_store_kv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_wait


@triton.jit
def _norm_rotate(
    x1,  # [BLOCK_H, BLOCK_HALF] the first half of the rotary dims (fp32)
    x2,  # [BLOCK_H, BLOCK_HALF] the second half
    x3,  # [BLOCK_H, BLOCK_REST] the dims past rotary (zeros when there are none)
    w_ptr,  # [head_dim] norm weight (HAS_NORM only)
    dims,
    rest,
    eps,
    cos,
    sin,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Each head's RMSNorm (optional), then the rotation of its first 2 * HALF dims: the
    rotated halves and the rest, each rounded to DTYPE and back to fp32."""
    if HAS_NORM:
        mean_sq = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)) / HEAD_DIM
        inv = tl.rsqrt(mean_sq + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + 2 * HALF + rest, mask=rest < HEAD_DIM - 2 * HALF, other=0.0)
        # As the norm kernel: the normed value rounds to the dtype, then times the weight.
        x1 = (w1[None, :] * (x1 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2[None, :] * (x2 * inv).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x3 = (w3.to(tl.float32)[None, :] * (x3 * inv).to(DTYPE).to(tl.float32)).to(DTYPE)
        x3 = x3.to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    return out1, out2, x3


@triton.jit
def _load(ptr, mask, stride_part, NUM_PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 values at ptr; with NUM_PARTS, the sum of that many split-K partial sums
    stride_part apart, in order, rounded to DTYPE as split_k.sum_splits writes it."""
    if NUM_PARTS > 0:
        acc = tl.load(ptr, mask=mask, other=0.0)
        for p in tl.static_range(1, NUM_PARTS):
            acc += tl.load(ptr + p * stride_part, mask=mask, other=0.0)
        return acc.to(DTYPE).to(tl.float32)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_head_parts(
    ptr,
    heads,
    dims,
    rest,
    num_heads,
    stride_part,
    HALF,
    HEAD_DIM,
    HAS_REST: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """A token's heads [heads, head_dim] (base pointer at the token, heads' stride applied by
    the caller) as fp32 parts: rotary halves and the dims past rotary."""
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    x1 = _load(ptr + dims[None, :], mask, stride_part, NUM_PARTS, DTYPE)
    x2 = _load(ptr + HALF + dims[None, :], mask, stride_part, NUM_PARTS, DTYPE)
    rest_mask = (heads < num_heads)[:, None] & (rest < HEAD_DIM - 2 * HALF)[None, :]
    if HAS_REST:
        x3 = _load(ptr + 2 * HALF + rest[None, :], rest_mask, stride_part, NUM_PARTS, DTYPE)
    else:
        x3 = tl.zeros(rest_mask.shape, dtype=tl.float32)
    return x1, x2, x3, mask, rest_mask


@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _rope_store_kernel(
    positions_ptr,  # [T]
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    q_out_ptr,  # [T, H, D]: query_ptr itself (in place) unless NUM_PARTS
    cos_sin_ptr,  # [max_position, 2 * HALF]: cos then sin
    q_norm_ptr,  # [D] (HAS_NORM only)
    k_norm_ptr,  # [D] (HAS_NORM only)
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int64, -1 = not stored
    eps,
    k_scale,  # fp8 caches: the stored value is k / k_scale
    v_scale,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_part,  # between the partial sums of query, key and value (NUM_PARTS only)
    stride_qo_tok,
    stride_qo_head,
    stride_cs_pos,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # pow2 >= max(H, Hkv)
    BLOCK_HALF: tl.constexpr,  # pow2 >= HALF
    BLOCK_REST: tl.constexpr,  # pow2 >= HEAD_DIM - 2 * HALF (1 when there are none)
    BLOCK_D: tl.constexpr,  # pow2 >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HAS_NORM: tl.constexpr,
    HAS_REST: tl.constexpr,
    FP8: tl.constexpr,  # the caches are e4m3
    PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
    NUM_PARTS: tl.constexpr = 0,  # query, key and value are fp32 split-K partial sums
):
    # Before the wait (kernels/pdl.py): the token's position, rotary row and slot, which no
    # kernel of this step writes; the projections come from the kernel before, after it.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    rest = tl.arange(0, BLOCK_REST)
    heads = tl.arange(0, BLOCK_H)
    cs_row = cos_sin_ptr + pos * stride_cs_pos
    cos = tl.load(cs_row + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    pdl_wait(PDL)

    # Query: normed and rotated (in place, or from partial sums into q_out).
    q_ptr = query_ptr + tok * stride_q_tok + heads[:, None] * stride_q_head
    q1, q2, q3, q_mask, q_rest_mask = _load_head_parts(
        q_ptr, heads, dims, rest, NUM_HEADS, stride_part, HALF, HEAD_DIM, HAS_REST, NUM_PARTS, dtype
    )
    q1, q2, q3 = _norm_rotate(
        q1, q2, q3, q_norm_ptr, dims, rest, eps, cos, sin, HALF, HEAD_DIM, HAS_NORM, dtype
    )
    qo_ptr = q_out_ptr + tok * stride_qo_tok + heads[:, None] * stride_qo_head
    tl.store(qo_ptr + dims[None, :], q1.to(dtype), mask=q_mask)
    tl.store(qo_ptr + HALF + dims[None, :], q2.to(dtype), mask=q_mask)
    if HAS_REST and (HAS_NORM or NUM_PARTS > 0):
        tl.store(qo_ptr + 2 * HALF + rest[None, :], q3.to(dtype), mask=q_rest_mask)

    if slot >= 0:
        # Key: normed, rotated, then into the cache (rounded to the activations' dtype first,
        # as the unfused rotary leaves it, then to the cache's).
        k_ptr = key_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head
        k1, k2, k3, k_mask, k_rest_mask = _load_head_parts(
            k_ptr,
            heads,
            dims,
            rest,
            NUM_KV_HEADS,
            stride_part,
            HALF,
            HEAD_DIM,
            HAS_REST,
            NUM_PARTS,
            dtype,
        )
        k1, k2, k3 = _norm_rotate(
            k1, k2, k3, k_norm_ptr, dims, rest, eps, cos, sin, HALF, HEAD_DIM, HAS_NORM, dtype
        )
        k1 = k1.to(dtype).to(tl.float32)
        k2 = k2.to(dtype).to(tl.float32)
        if FP8:
            k1 = tl.clamp(k1 / k_scale, -448.0, 448.0)
            k2 = tl.clamp(k2 / k_scale, -448.0, 448.0)
            k3 = tl.clamp(k3 / k_scale, -448.0, 448.0)
        block_id = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kc_ptr = (
            key_cache_ptr
            + block_id * stride_kc_block
            + offset * stride_kc_slot
            + heads[:, None] * stride_kc_head
        )
        cache_dtype = key_cache_ptr.dtype.element_ty
        tl.store(kc_ptr + dims[None, :], k1.to(cache_dtype), mask=k_mask)
        tl.store(kc_ptr + HALF + dims[None, :], k2.to(cache_dtype), mask=k_mask)
        if HAS_REST:
            tl.store(kc_ptr + 2 * HALF + rest[None, :], k3.to(cache_dtype), mask=k_rest_mask)
        # Value: as it is.
        all_dims = tl.arange(0, BLOCK_D)
        v_mask = (heads < NUM_KV_HEADS)[:, None] & (all_dims < HEAD_DIM)[None, :]
        v_src = value_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head
        if NUM_PARTS > 0:
            v = _load(v_src + all_dims[None, :], v_mask, stride_part, NUM_PARTS, dtype)
        else:
            v = tl.load(v_src + all_dims[None, :], mask=v_mask, other=0.0)
        if FP8:
            v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
        vc_ptr = (
            value_cache_ptr
            + block_id * stride_vc_block
            + offset * stride_vc_slot
            + heads[:, None] * stride_vc_head
        )
        tl.store(vc_ptr + all_dims[None, :], v.to(cache_dtype), mask=v_mask)


def rope_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm of query and key (when the weights are given), NeoX rotary on both,
    then key and value into their cache slots (slot -1: not stored). Returns query, rotated
    in place. The same result as reference.rope_store_kv.

    Query, key and value may instead be [P, T, heads, D] fp32 views of a split-K
    projection's partial sums (one tensor, models/split_sums.py), with `dtype` the
    activations': each is their in-order sum rounded to `dtype`, and the rotated query comes
    back in a new [T, H, D] tensor."""
    parts = query.dim() == 4
    stride_part = 0
    if parts:
        if dtype is None or query.dtype != torch.float32:
            raise ValueError("partial sums for query, key and value need fp32 and a dtype")
        if not (query.stride(0) == key.stride(0) == value.stride(0)):
            raise ValueError("query, key and value partial sums must be views of one tensor")
        num_parts, stride_part = query.shape[0], query.stride(0)
        q_out = torch.empty(query.shape[1:], dtype=dtype, device=query.device)
        query, key, value = query[0], key[0], value[0]
    else:
        num_parts, q_out = 0, query
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    rotary_dim = cos_sin_cache.shape[-1]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit query "
            f"{tuple(query.shape)} and a cache of {tuple(key_cache.shape)}"
        )
    if cache_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(f"the caches {tuple(key_cache.shape)} do not fit heads of {head_dim}")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together")
    if q_norm_weight is not None and k_norm_weight is not None:
        for weight in (q_norm_weight, k_norm_weight):
            if weight.shape != (head_dim,) or weight.dtype != q_out.dtype:
                raise ValueError(
                    f"a q/k norm weight must be [{head_dim}] of {q_out.dtype}, got "
                    f"{tuple(weight.shape)} of {weight.dtype}"
                )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("the caches and cos_sin_cache need a contiguous last dimension")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {num_tokens} tokens")
    if num_tokens == 0:
        return q_out
    half = rotary_dim // 2
    block_h = triton.next_power_of_2(max(num_heads, num_kv_heads))
    block_half = triton.next_power_of_2(half)
    has_norm = q_norm_weight is not None
    pdl = pdl_enabled(query.device)
    _rope_store_kernel[(num_tokens,)](
        positions,
        query,
        key,
        value,
        q_out,
        cos_sin_cache,
        q_norm_weight if has_norm else cos_sin_cache,  # unread without a norm
        k_norm_weight if has_norm else cos_sin_cache,
        key_cache,
        value_cache,
        slot_mapping,
        eps,
        k_scale,
        v_scale,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        stride_part,
        q_out.stride(0),
        q_out.stride(1),
        cos_sin_cache.stride(0),
        key_cache.stride(0),  # may exceed 2**31
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_REST=triton.next_power_of_2(max(1, head_dim - rotary_dim)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        HAS_NORM=has_norm,
        HAS_REST=rotary_dim < head_dim,
        FP8=key_cache.dtype == torch.float8_e4m3fn,
        PDL=pdl,
        NUM_PARTS=num_parts,
        num_warps=4 if block_h * block_half >= 1024 else 1,
        **pdl_launch(pdl),
    )
    return q_out
