"""Triton 4-bit weight-only matmuls (W4A16): x [M, K] @ W^T with W in the int4 layout of
kernels/quant_reference.py (qweight int32 [N, K / 8], scales / zeros [N, groups], optional g_idx).

Three kernels; int4_matmul picks one by the number of tokens and the group layout:
- For small batches (decode), the split-K GEMV of kernels/int4_gemv.py, whose time is the
  packed bytes read.
- For more tokens with whole groups along K (no g_idx, a power-of-two group size: nearly
  every checkpoint), `_int4_group_gemm_kernel`: a K step lies inside one group, so the dot
  takes the raw nibbles (0-15, exact in bf16) and the group's scale and zero apply to the
  step's [M, N] sums, `scale * (x @ q - zero * sum x)`; per weight element only an unpack.
Symmetric weights (zeros None: every zero SYMMETRIC_ZERO) read no zeros in any of them.
- Otherwise (act order, odd group sizes) `_int4_gemm_kernel`: each tile dequantized per
  element in fp32, a scale and zero looked up per column.
References: quant_reference.int4_matmul.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncserve.kernels.int4_gemv import int4_gemv
from asyncserve.kernels.quant_reference import SYMMETRIC_ZERO as _ZERO
from asyncserve.kernels.split_k import (
    GEMV_MAX_TOKENS,
    pick_split_k,
    sm_count,
    split_layout,
    sum_splits,
)

# Symmetric weights' zero point, as a constant the kernels can read.
SYMMETRIC_ZERO = tl.constexpr(_ZERO)
# The interpreter (CPU tests) mis-converts a computed fp32 tile to bf16 before a dot; there
# the tiles are multiplied in fp32 instead (x widened), which the reference also does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
__all__ = [
    "GEMV_MAX_TOKENS",
    "GroupGemmConfig",
    "group_gemm_config",
    "int4_group_gemm",
    "int4_matmul",
]


@dataclass(frozen=True)
class GroupGemmConfig:
    """Launch shape of the whole-group GEMM: tile sizes, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # K splits (grid axis 2), their fp32 partial sums added by split_k.sum_splits: more
    # programs when a few tokens' tiles alone leave SMs idle.
    split_k: int = 1


def group_gemm_config(m: int, n: int, group_size: int, k: int = 0, sms: int = 1) -> GroupGemmConfig:
    """The tile for M tokens, N outputs and K inputs on a device of `sms` SMs, from sweeps on
    an H200 over Llama-3-8B's four shapes (benchmarks/int4_gemm_bench.py --sweep [--split]).

    Tiles: 64 outputs, 4 warps and 3 stages were best or within 1% at 16, 128 and 1024 tokens
    (the sums 0.48, 0.51 and 2.50 ms against 0.56, 0.70 and 3.16 ms at 128 outputs); M tiles
    of up to 64 rows, 128 past 128 tokens or when N alone fills the GPU (gate_up at 128
    tokens: 0.20 against 0.24 ms). K steps of a whole group up to 128 columns.

    K splits: the fewest that give the grid 1.5 programs an SM. At 16 tokens 128-output tiles
    with splits beat the unsplit 64-output tiles on every shape (--m 16 --split: qkv 0.032
    against 0.057 ms at 8 splits, o_proj 0.023 against 0.056, down_proj 0.064 against 0.183;
    gate_up 0.133 unsplit, its 224 tiles already 1.7 an SM; down_proj's 112 steps take 7, the
    fewest dividing them); at 128 tokens two splits take o_proj from 0.049 to 0.040 ms and
    down_proj from 0.153 to 0.120. On the CPU (sms=1) K stays whole."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    if m > 128 or (m > 64 and n >= 16384):
        block_m = 128
    block_k = min(128, group_size)
    # A few tokens: 128 outputs a tile (gate_up at 16 tokens: 0.125 against 0.18 ms; the
    # others with their K splits, above).
    block_n = 128 if m <= 16 else 64
    split_k = 1
    if sms > 1 and k % block_k == 0:
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split_k = pick_split_k(tiles, k // block_k, sms, programs_per_sm=1.5)
    return GroupGemmConfig(block_m, block_n, block_k, 4, 3, split_k)


@triton.jit
def _dequant_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    offs_n,
    mask_n,
    k0,
    k,
    stride_qn,
    stride_sn,
    GROUP: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    """fp32 (q - zero) * scale of outputs offs_n x inputs k0..k0+BLOCK_K: [BLOCK_N, BLOCK_K].
    Each packed word is read once, [BLOCK_N, BLOCK_K / 8] of them, and unpacked in registers
    (nibble i of word j -> column 8j + i: a row-major reshape)."""
    offs_w = tl.arange(0, BLOCK_K // 8)
    words = tl.load(
        qw_ptr + offs_n[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :],
        mask=mask_n[:, None] & ((k0 + offs_w * 8) < k)[None, :],
        other=0,
    )
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 0xF
    q = tl.reshape(q, [BLOCK_N, BLOCK_K]).to(tl.float32)
    ks = k0 + tl.arange(0, BLOCK_K)
    mask_k = ks < k
    if HAS_GIDX:
        group = tl.load(gidx_ptr + ks, mask=mask_k, other=0)[None, :]
    else:
        group = (ks // GROUP)[None, :]
    mask = mask_n[:, None] & mask_k[None, :]
    scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + group, mask=mask, other=0.0)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + offs_n[:, None] * stride_sn + group, mask=mask, other=0.0)
        zero = zero.to(tl.float32)
    else:
        zero = SYMMETRIC_ZERO
    return (q - zero) * scale.to(tl.float32)


@triton.jit(do_not_specialize=["m"])  # m (tokens) changes every step
def _int4_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=mask_m[:, None] & (ks < k)[None, :],
            other=0.0,
        )
        w = tl.trans(
            _dequant_tile(
                qw_ptr,
                s_ptr,
                z_ptr,
                gidx_ptr,
                offs_n,
                mask_n,
                k0,
                k,
                stride_qn,
                stride_sn,
                GROUP,
                HAS_GIDX,
                BLOCK_N,
                BLOCK_K,
                HAS_ZEROS,
            )
        )  # [BLOCK_K, BLOCK_N]
        if IEEE_DOT:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["m"])  # m (tokens) changes every step
def _int4_group_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    m,
    n,
    k,
    k_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    stride_osplit,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
):
    """out[split] tile = sum over the split's K steps of scale * (x @ q^T - zero * sum x):
    BLOCK_K divides GROUP, so a step's columns share one scale and zero per output row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, k)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    rows = tl.minimum(offs_n, n - 1)  # rows past N re-read row N - 1; only the store is masked
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + ks[None, :]
        w_ptrs = qw_ptr + rows[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            words = tl.load(w_ptrs)
        else:
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (ks < k_end)[None, :], other=0.0)
            words = tl.load(w_ptrs, mask=((k0 + offs_w * 8) < k_end)[None, :], other=0)
        # Nibble i of word j is column 8j + i: a row-major reshape.
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K])
        if IEEE_DOT:
            xf = x.to(tl.float32)
            part = tl.dot(xf, tl.trans(q.to(tl.float32)), input_precision="ieee")
        else:
            xf = x.to(tl.float32)
            part = tl.dot(x, tl.trans(q.to(x.dtype)))
        group = rows * stride_sn + k0 // GROUP
        scale = tl.load(s_ptr + group).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group).to(tl.float32)
        else:
            zero = SYMMETRIC_ZERO
        x_sum = tl.sum(xf, axis=1)
        acc += part * scale[None, :] - x_sum[:, None] * (zero * scale)[None, :]
    out = out_ptr + pid_k * stride_osplit + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < n)[None, :])


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    config: GroupGemmConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N] in x's dtype; the GEMV for M <= GEMV_MAX_TOKENS;
    `config` overrides group_gemm_config's tile for the whole-group GEMM."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] * 8 != k or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not match an int4 weight of {n} x {k}")
    if (zeros is not None and scales.stride() != zeros.stride()) or scales.stride(1) != 1:
        raise ValueError("int4 scales and zeros must be contiguous [N, groups] matrices")
    if m <= GEMV_MAX_TOKENS:
        return int4_gemv(x, qweight, scales, zeros, g_idx, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if g_idx is None and group_size & (group_size - 1) == 0 and group_size >= 16:
        int4_group_gemm(x, qweight, scales, zeros, group_size, out, config)
        return out
    gidx = g_idx if g_idx is not None else scales  # unused when HAS_GIDX is False
    common = (qweight, scales, zeros if zeros is not None else scales, gidx, out)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, 64))](
        x,
        *common,
        m,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=group_size,
        HAS_GIDX=g_idx is not None,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=64,
        IEEE_DOT=x.dtype == torch.float32 or _INTERPRET,
        HAS_ZEROS=zeros is not None,
    )
    return out


def int4_group_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    out: torch.Tensor,
    config: GroupGemmConfig | None = None,
) -> None:
    """out [M, N] = x @ dequant(W)^T through the whole-group GEMM at any number of tokens
    (int4_matmul sends it only past the GEMV's); groups of a power of two, no g_idx."""
    m, k = x.shape
    n = qweight.shape[0]
    if config is None:
        config = group_gemm_config(m, n, group_size, k, sm_count(x.device))
    if group_size % config.block_k:
        raise ValueError(
            f"int4 GEMM block_k {config.block_k} does not divide groups of {group_size}"
        )
    k_split, splits, even_k = split_layout(k, config.block_k, config.split_k)
    target = out
    if splits > 1:
        target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
    _int4_group_gemm_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,  # unused when HAS_ZEROS is False
        target,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        target.stride(-2),
        target.stride(0) if splits > 1 else 0,
        GROUP=group_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=even_k,
        IEEE_DOT=x.dtype == torch.float32 or _INTERPRET,
        HAS_ZEROS=zeros is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        sum_splits(target, out)
