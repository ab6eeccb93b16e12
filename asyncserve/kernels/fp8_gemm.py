"""Triton FP8 (e4m3) kernels: per-token-group activation quantization and the block-scaled
FP8 GEMM of "FP8-block" checkpoints (DeepSeek-V3 style: one weight scale per 128 x 128 tile,
one activation scale per token and 128 columns).

References: kernels/quant_reference.py (per_token_group_quant_fp8, w8a8_block_fp8_matmul), which
take the same arguments and return the same results.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_wait
from asyncserve.kernels.quant_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

# The interpreter (CPU tests) has no fp8 dot: it widens the tiles to fp32 first, which gives
# the same sums (every e4m3 value is exact in fp32).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    k,
    stride_x,
    stride_q,
    stride_s,
    fp8_max,
    min_scale,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = tl.program_id(0)
    group = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    cols = group * GROUP + lanes
    mask = (lanes < GROUP) & (cols < k)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + group, scale)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / group_size)]); group_size = K is
    per-token quantization."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be a row-major [M, K] matrix, got shape {tuple(x.shape)}")
    m, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    pdl = pdl_enabled(x.device)
    _group_quant_kernel[(m, groups)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        FP8_MAX,
        FP8_MIN_SCALE,
        GROUP=group_size,
        BLOCK=triton.next_power_of_2(group_size),
        PDL=pdl,
        **pdl_launch(pdl),
    )
    return q, scale


@triton.jit(do_not_specialize=["m"])  # m (tokens) changes every step
def _block_fp8_matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    as_ptr,
    bs_ptr,
    m,
    n,
    k,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as_m,
    stride_bs_n,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WIDEN: tl.constexpr,
):
    # C[m, n] = sum over k-groups g of (A_g @ B_g^T) * a_scale[m, g] * b_scale[n // GN, g];
    # BLOCK_K divides GROUP_K, so one k-tile lies in one scale group.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < m
    mask_n = offs_n < n
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * stride_as_m
    bs_ptrs = bs_ptr + (offs_n // GROUP_N) * stride_bs_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_tile in range(0, tl.cdiv(k, BLOCK_K)):
        k_left = k - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        group = (k_tile * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptrs + group, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + group, mask=mask_n, other=0.0)
        if WIDEN:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8a8_block_fp8_matmul(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x_q [M, K] e4m3 with x_scale [M, K / bk] fp32; w_q [N, K] e4m3 with w_scale
    [N / bn, K / bk]; returns [M, N] in out_dtype."""
    m, k = x_q.shape
    n = w_q.shape[0]
    block_n, block_k = block
    if w_q.shape[1] != k or x_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError(f"shapes {tuple(x_q.shape)} x {tuple(w_q.shape)}^T do not multiply")
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return out
    # Small batches (decode) take narrow M tiles; BLOCK_K is the scale group, at most 128.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tile_k = min(block_k, 128)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    # The kernel steps along a scale row by 1: both scale matrices must be contiguous.
    w_scale = w_scale.float().contiguous()
    x_scale = x_scale.contiguous()
    _block_fp8_matmul_kernel[grid](
        x_q,
        w_q,
        out,
        x_scale,
        w_scale,
        m,
        n,
        k,
        x_q.stride(0),
        w_q.stride(0),
        out.stride(0),
        x_scale.stride(0),
        w_scale.stride(0),
        GROUP_N=block_n,
        GROUP_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=tile_k,
        WIDEN=_INTERPRET,
    )
    return out
