"""Triton LoRA shrink / expand (punica style): tokens grouped by adapter slot.

One launch serves a whole mixed batch: the grid's second axis is the adapter group, each
program takes BLOCK_M of its group's rows (gathered through `sorted_tokens`), so a prefill
chunk is a segmented GEMM (SGMV) and a decode batch a batched GEMV (BGMV) over the same
kernel. The grid depends only on the token count and the number of slots, never on which
adapters a step uses, so the launches can be captured in CUDA graphs: a replay reads the
current groups from the same buffers. Arguments and results are those of
reference.lora_shrink / reference.lora_expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    out_ptr,  # [T, R] fp32
    sorted_ptr,  # [T] int32
    slots_ptr,  # [G] int32
    starts_ptr,  # [G + 1] int32
    K,
    R,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per row block along K, summed atomically
    IEEE_DOT: tl.constexpr,  # fp32 weights: exact fp32 products (no TF32)
):
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(slots_ptr + group)
    start = tl.load(starts_ptr + group)
    count = tl.load(starts_ptr + group + 1) - start
    if slot < 0 or pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + k[None, :],
            mask=row_mask[:, None] & (k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a = tl.load(
            a_base + offs_r[None, :] * stride_ar + k[:, None],
            mask=(offs_r[None, :] < R) & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        x = x.to(a.dtype)
        acc += tl.dot(x, a, input_precision="ieee") if IEEE_DOT else tl.dot(x, a)
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_r[None, :]
    out_mask = row_mask[:, None] & (offs_r[None, :] < R)
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)


@triton.jit
def _lora_expand_kernel(
    buf_ptr,  # [T, R] fp32
    b_ptr,  # [S, N, R]
    y_ptr,  # [T, >= offset + N]
    sorted_ptr,  # [T] int32
    slots_ptr,  # [G] int32
    starts_ptr,  # [G + 1] int32
    N,
    R,
    offset,
    stride_bt,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    pid_n = tl.program_id(2)
    slot = tl.load(slots_ptr + group)
    start = tl.load(starts_ptr + group)
    count = tl.load(starts_ptr + group + 1) - start
    if slot < 0 or pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=row_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    buf = tl.load(
        buf_ptr + rows[:, None] * stride_bt + offs_r[None, :],
        mask=row_mask[:, None] & (offs_r[None, :] < R),
        other=0.0,
    )  # [BLOCK_M, BLOCK_R]
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None],
        mask=(offs_n[None, :] < N) & (offs_r[:, None] < R),
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    buf = buf.to(b.dtype)
    delta = tl.dot(buf, b, input_precision="ieee") if IEEE_DOT else tl.dot(buf, b)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offset + offs_n[None, :]
    mask = row_mask[:, None] & (offs_n[None, :] < N)
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_m(num_tokens: int) -> int:
    """Rows per program: small for decode batches (few rows per adapter), larger for
    prefill chunks, where each program then reloads the adapter's weights less often."""
    return 16 if num_tokens <= 256 else 64


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    sorted_tokens: torch.Tensor,
    group_slots: torch.Tensor,
    group_starts: torch.Tensor,
    out: torch.Tensor,
) -> None:
    num_tokens, k = x.shape
    if num_tokens == 0:
        return
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("lora_shrink needs unit last strides")
    rank = lora_a.shape[1]
    block_m, block_k = _block_m(num_tokens), 64
    # A decode batch has few row blocks: split K so enough programs share the reads.
    split_k = max(1, min(16, k // (4 * block_k))) if num_tokens <= 256 else 1
    if split_k > 1:
        out[:num_tokens].zero_()
    grid = (triton.cdiv(num_tokens, block_m), group_slots.shape[0], split_k)
    _lora_shrink_kernel[grid](
        x,  # [T, K]
        lora_a,  # [S, R, K]
        out,  # [T, R]
        sorted_tokens,  # [T]
        group_slots,  # [G]
        group_starts,  # [G + 1]
        k,
        rank,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_R=_block_r(rank),
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        IEEE_DOT=lora_a.dtype == torch.float32,
    )


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_tokens: torch.Tensor,
    group_slots: torch.Tensor,
    group_starts: torch.Tensor,
    y: torch.Tensor,
    offset: int,
) -> None:
    num_tokens = buf.shape[0]
    if num_tokens == 0:
        return
    if buf.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("lora_expand needs unit last strides")
    width, rank = lora_b.shape[1], lora_b.shape[2]
    block_m, block_n = _block_m(num_tokens), 128
    grid = (triton.cdiv(num_tokens, block_m), group_slots.shape[0], triton.cdiv(width, block_n))
    _lora_expand_kernel[grid](
        buf,  # [T, R]
        lora_b,  # [S, N, R]
        y,  # [T, >= offset + N]
        sorted_tokens,  # [T]
        group_slots,  # [G]
        group_starts,  # [G + 1]
        width,
        rank,
        offset,
        buf.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=_block_r(rank),
        IEEE_DOT=lora_b.dtype == torch.float32,
    )
