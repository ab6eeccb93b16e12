"""Triton dequantizing matmuls for GGUF weights kept quantized: x [M, K] @ W^T with W in the
repacked layout of kernels/quant_reference.py (dequant_gguf): int8 [N, K] (Q8_0) or packed
nibbles int32 [N, K / 8] (Q4_1, Q4_K), fp16 scales / minimums per block or super-block, and
for Q4_K uint8 sub-block factors.

As for int4 (int4_gemm.py), two kernels share one tile dequantizer: a GEMM for prefill
(tiles of W dequantized in registers in fp32, the reference's order, and fed to tl.dot) and
a GEMV for decode (narrow output blocks so a step's layers fill the SMs; products summed in
fp32). Reference: quant_reference.gguf_matmul.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from asyncserve.kernels.quant_reference import GGUF_SUB_BLOCK

# The interpreter (CPU tests) mis-converts a computed fp32 tile to bf16 before a dot; there
# the tiles are multiplied in fp32 instead (x widened), which the reference also does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GEMV_MAX_TOKENS = 4


@triton.jit
def _dequant_tile(
    qw_ptr,
    s_ptr,
    mn_ptr,
    ss_ptr,
    sm_ptr,
    offs_n,
    mask_n,
    k0,
    stride_qn,
    stride_sn,
    stride_subn,
    EIGHT_BIT: tl.constexpr,
    SUPER: tl.constexpr,
    SUB: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 weights of outputs offs_n x inputs k0..k0+BLOCK_K: [BLOCK_N, BLOCK_K]. K is a
    multiple of BLOCK_K (a multiple of 32 dividing K), so only N is masked."""
    if EIGHT_BIT:
        ks = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(
            qw_ptr + offs_n[:, None] * stride_qn + ks[None, :], mask=mask_n[:, None], other=0
        ).to(tl.float32)
    else:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(
            qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask_n[:, None], other=0
        )
        shifts = tl.arange(0, 8) * 4
        q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        q = tl.reshape(q, [BLOCK_N, BLOCK_K]).to(tl.float32)
    # Scales once per 32-value sub-block (not per value), broadcast over its values.
    subs = k0 // SUB + tl.arange(0, BLOCK_K // SUB)
    at_s = offs_n[:, None] * stride_sn + (subs // (SUPER // SUB))[None, :]
    scale = tl.load(s_ptr + at_s, mask=mask_n[:, None], other=0.0).to(tl.float32)
    if HAS_SUB:
        at_sub = offs_n[:, None] * stride_subn + subs[None, :]
        scale = scale * tl.load(ss_ptr + at_sub, mask=mask_n[:, None], other=0).to(tl.float32)
    w = scale[:, :, None] * tl.reshape(q, [BLOCK_N, BLOCK_K // SUB, SUB])
    if HAS_MIN:
        mn = tl.load(mn_ptr + at_s, mask=mask_n[:, None], other=0.0).to(tl.float32)
        if HAS_SUB:
            mn = mn * tl.load(sm_ptr + at_sub, mask=mask_n[:, None], other=0).to(tl.float32)
        w = w - mn[:, :, None]
    w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    return w


@triton.jit(do_not_specialize=["m"])  # m (tokens) changes every step
def _gguf_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    mn_ptr,
    ss_ptr,
    sm_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_subn,
    stride_om,
    EIGHT_BIT: tl.constexpr,
    SUPER: tl.constexpr,
    SUB: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_SUB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None])
        w = tl.trans(
            _dequant_tile(
                qw_ptr,
                s_ptr,
                mn_ptr,
                ss_ptr,
                sm_ptr,
                offs_n,
                mask_n,
                k0,
                stride_qn,
                stride_sn,
                stride_subn,
                EIGHT_BIT,
                SUPER,
                SUB,
                HAS_MIN,
                HAS_SUB,
                BLOCK_N,
                BLOCK_K,
            )
        )  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gguf_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    mn_ptr,
    ss_ptr,
    sm_ptr,
    out_ptr,
    n,
    k,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_subn,
    stride_om,
    EIGHT_BIT: tl.constexpr,
    SUPER: tl.constexpr,
    SUB: tl.constexpr,
    HAS_MIN: tl.constexpr,
    HAS_SUB: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        w = _dequant_tile(
            qw_ptr,
            s_ptr,
            mn_ptr,
            ss_ptr,
            sm_ptr,
            offs_n,
            mask_n,
            k0,
            stride_qn,
            stride_sn,
            stride_subn,
            EIGHT_BIT,
            SUPER,
            SUB,
            HAS_MIN,
            HAS_SUB,
            BLOCK_N,
            BLOCK_K,
        )  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _block_k(k: int, largest: int) -> int:
    return next(b for b in (largest, 128, 64, GGUF_SUB_BLOCK) if b <= largest and k % b == 0)


def gguf_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    sub_scale: torch.Tensor | None,
    sub_min: torch.Tensor | None,
    super_block: int,
) -> torch.Tensor:
    """x [M, K] @ dequant_gguf(...)^T -> [M, N] in x's dtype; the GEMV for M <=
    GEMV_MAX_TOKENS."""
    m, k = x.shape
    n = qweight.shape[0]
    if k % GGUF_SUB_BLOCK or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not fit a GGUF weight of {n} x {k}")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    unused = scale  # passed where a flag says the tensor is absent; never read
    args = (
        qweight,
        scale,
        minimum if minimum is not None else unused,
        sub_scale if sub_scale is not None else unused,
        sub_min if sub_min is not None else unused,
        out,
    )
    strides = (
        x.stride(0),
        qweight.stride(0),
        scale.stride(0),
        sub_scale.stride(0) if sub_scale is not None else 0,
        out.stride(0),
    )
    flags = dict(
        EIGHT_BIT=qweight.dtype == torch.int8,
        SUPER=super_block,
        SUB=GGUF_SUB_BLOCK,
        HAS_MIN=minimum is not None,
        HAS_SUB=sub_scale is not None,
    )
    if m <= GEMV_MAX_TOKENS:
        grid = (triton.cdiv(n, 32), m)
        _gguf_gemv_kernel[grid](
            x, *args, n, k, *strides, **flags, BLOCK_N=32, BLOCK_K=_block_k(k, 256)
        )
        return out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _gguf_gemm_kernel[grid](
        x,
        *args,
        m,
        n,
        k,
        *strides,
        **flags,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=_block_k(k, 64),
        IEEE_DOT=x.dtype == torch.float32 or _INTERPRET,
    )
    return out
