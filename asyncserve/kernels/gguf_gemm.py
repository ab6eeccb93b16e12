"""Triton dequantizing GEMM for GGUF weights kept quantized: x [M, K] @ W^T with W in the
repacked layout of kernels/quant_reference.py (dequant_gguf): int8 [N, K] (Q8_0) or packed
nibbles int32 [N, K / 8] (Q4_1, Q4_K), fp16 scales / minimums per block or super-block, and
for Q4_K uint8 sub-block factors.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K; a [BLOCK_N, BLOCK_K] tile
of W is read in its packed form, dequantized in registers in fp32 (the reference's order)
and fed to tl.dot. Reference: quant_reference.gguf_matmul.
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


@triton.jit
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
    FP32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a multiple of BLOCK_K (32, 64 or 128): no K mask needed.
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EIGHT_BIT:
            q = tl.load(
                qw_ptr + offs_n[:, None] * stride_qn + ks[None, :], mask=mask_n[:, None], other=0
            ).to(tl.float32)
        else:
            offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words = tl.load(
                qw_ptr + offs_n[:, None] * stride_qn + offs_w[None, :],
                mask=mask_n[:, None],
                other=0,
            )
            shifts = tl.arange(0, 8) * 4
            q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
            q = tl.reshape(q, [BLOCK_N, BLOCK_K]).to(tl.float32)
        row_s = offs_n[:, None] * stride_sn + (ks // SUPER)[None, :]
        scale = tl.load(s_ptr + row_s, mask=mask_n[:, None], other=0.0).to(tl.float32)
        if HAS_SUB:
            row_sub = offs_n[:, None] * stride_subn + (ks // SUB)[None, :]
            sc = tl.load(ss_ptr + row_sub, mask=mask_n[:, None], other=0).to(tl.float32)
            scale = scale * sc
        w = scale * q
        if HAS_MIN:
            mn = tl.load(mn_ptr + row_s, mask=mask_n[:, None], other=0.0).to(tl.float32)
            if HAS_SUB:
                mn = mn * tl.load(sm_ptr + row_sub, mask=mask_n[:, None], other=0).to(tl.float32)
            w = w - mn
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None])
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w).to(x.dtype))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        out,
        mask=mask_m[:, None] & mask_n[None, :],
    )


def gguf_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    sub_scale: torch.Tensor | None,
    sub_min: torch.Tensor | None,
    super_block: int,
) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequant_gguf(...)^T, in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    if k % GGUF_SUB_BLOCK:
        raise ValueError(f"GGUF matmul needs K a multiple of {GGUF_SUB_BLOCK}, got {k}")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    block_k = next(b for b in (128, 64, GGUF_SUB_BLOCK) if k % b == 0)
    has_sub = sub_scale is not None
    dummy = scale  # never read when the flag is off
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_gemm_kernel[grid](
        x,
        qweight,
        scale,
        minimum if minimum is not None else dummy,
        sub_scale if sub_scale is not None else dummy,
        sub_min if sub_min is not None else dummy,
        out,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scale.stride(0),
        sub_scale.stride(0) if sub_scale is not None else 0,
        out.stride(0),
        EIGHT_BIT=qweight.dtype == torch.int8,
        SUPER=super_block,
        SUB=GGUF_SUB_BLOCK,
        HAS_MIN=minimum is not None,
        HAS_SUB=has_sub,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_DOT=_INTERPRET or x.dtype == torch.float32,
    )
    return out
