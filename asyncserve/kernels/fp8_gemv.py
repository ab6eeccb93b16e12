"""Triton FP8 GEMV for decode (W8A8, one to a few tokens): out [M, N] = (x_q . w_q) * sx * sw
+ bias, the numbers of the row-wise W8A8 path (quantization/fp8.py, torch._scaled_mm):
x_q [M, K] e4m3 with one fp32 scale a token (kernels/fp8_gemm.per_token_group_quant_fp8(x,
K): amax / 448, clamped at FP8_MIN_SCALE), w_q [N, K] e4m3 with one fp32 scale a row (or one
for the whole tensor). Products of the e4m3 values are summed in fp32 (every e4m3 value and
product is exact there), then times the token's and the row's scales, plus the bias.
At batch 1 a layer's time is the weight's bytes read, so the kernel streams them:

- A program takes block_n weight rows, read along K (contiguous) in steps of block_k
  columns, 16 bytes a load; per element one conversion and one multiply-add into a
  [block_n, block_k] fp32 accumulator, summed across K once at the end.
- Split-K as the int4 GEMV (kernels/split_k.py): programs take a slice of K each, so a 4096 x
  4096 layer still runs several programs per SM; the slices' fp32 partial sums (scaled
  already: the scales distribute over the sum) are added in split order by a second small
  kernel (deterministic). Split 0 adds the bias.
- Launched with programmatic dependent launch (kernels/pdl.py), a program prefetches its
  first step's weight bytes into L2 before it waits for the kernel before it.

The token's scale comes from the quantization kernel the GEMM path runs anyway (one launch
before the GEMV), not from inside the GEMV: every FP8 element must be divided by a scale
that needs the whole row's amax, so each program of a split grid would first read the
token's whole row from L2 (down_proj of Llama-3-8B: 4 splits x 256 blocks, each reading
28 KiB of x, 28 MiB of L2 reads before the first weight byte, against 56 MiB of
weights). One more kernel node in the decode step's CUDA graph costs no such prologue,
the GEMV reads 1-byte x, and the numerics are the GEMM path's by construction.
References: quant_reference.fp8_rowwise_matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_prefetch_l2, pdl_wait
from asyncserve.kernels.quant_reference import FP8_DTYPE
from asyncserve.kernels.split_k import (
    GemvConfig,
    gemv_program,
    pick_split_k,
    prefetch_lines,
    sm_count,
    split_layout,
    sum_splits,
)

# The GEMV serves one token; from 2 on, torch._scaled_mm. On an H100, Llama-3-8B's four
# layers at M=1 took 0.102 ms with the GEMV (activation quantization included) against
# _scaled_mm's 0.141; at M=4, 0.191 against 0.144 (benchmarks/fp8_gemv_bench.py --m 4).
FP8_GEMV_MAX_TOKENS = 1
# Fewer programs per SM than the int4 GEMV aims for: an fp8 row is twice the bytes a column,
# and one split was fastest on every Llama-3-8B shape in the sweep.
_PROGRAMS_PER_SM = 3


def fp8_gemv_config(n: int, k: int, sms: int) -> GemvConfig:
    """The launch shape for an N x K e4m3 weight on a GPU of `sms` SMs, from the shape alone.

    block_n 8 x block_k 512 with 4 warps, the loop's loads four steps deep (tl.range's
    pipelining: a program keeps 16 KiB of rows in flight instead of one 4 KiB step). On an
    H100 (benchmarks/fp8_gemv_bench.py --sweep --narrow --stages 1,2,3,4) the fastest tile on
    three Llama-3-8B shapes and within 1% on qkv: the layers' sum 0.0818 ms against 0.0874
    for 8 x 1024 without pipelining (the tile before). Then K is split as
    kernels/split_k.pick_split_k says, aiming at 3 programs per SM: Llama-3-8B's layers on
    132 SMs get one split each (qkv 768 programs, o and down 512, gate_up 3584), the
    fastest split in the sweep.
    """
    block_n = 8
    block_k = max(16, min(512, triton.next_power_of_2(k)))
    split_k = pick_split_k(
        triton.cdiv(n, block_n), triton.cdiv(k, block_k), sms, programs_per_sm=_PROGRAMS_PER_SM
    )
    return GemvConfig(block_n, block_k, split_k, num_stages=4)


@triton.jit
def _fp8_gemv_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    k_split,
    stride_xm,
    stride_xs,
    stride_wn,
    stride_ws,
    stride_om,
    stride_osplit,
    HAS_BIAS: tl.constexpr,
    X_SCALED: tl.constexpr,  # x is e4m3 with a scale a token; else x is bf16/fp16/fp32
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[split, row, n-block] = the split's K slice of x[row] . w_q[n-block] times the
    scales (plus the bias in split 0); the grid as split_k.gemv_program says."""
    row, offs_n, mask_n, rows, pid_k, k_start, k_end = gemv_program(m, n, k, k_split, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None] * stride_wn
    x_row = xq_ptr + row * stride_xm
    if PREFETCH_LINES > 0:
        # Weight bytes into L2 while the kernel before still runs (kernels/pdl.py).
        lines = tl.minimum(k_start + tl.arange(0, PREFETCH_LINES) * 128, k_end - 1)
        pdl_prefetch_l2(w_rows + lines[None, :], PDL)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + cols[None, :])
            xq = tl.load(x_row + cols)
        else:
            in_k = cols < k_end
            w = tl.load(w_rows + cols[None, :], mask=in_k[None, :], other=0.0)
            xq = tl.load(x_row + cols, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * xq.to(tl.float32)[None, :]
    scale = tl.load(ws_ptr + rows * stride_ws)
    if X_SCALED:
        scale *= tl.load(xs_ptr + row * stride_xs)
    result = tl.sum(acc, axis=1) * scale
    if HAS_BIAS:  # once, in split 0
        bias = tl.load(bias_ptr + rows).to(tl.float32)
        result += tl.where(pid_k == 0, bias, 0.0)
    out = out_ptr + pid_k * stride_osplit + row * stride_om + offs_n
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=mask_n)


def _check(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    if x_q.dim() != 2 or w_q.dim() != 2 or x_q.shape[1] != w_q.shape[1] or x_q.shape[1] == 0:
        raise ValueError(
            f"FP8 GEMV: x {tuple(x_q.shape)} does not multiply a weight of {tuple(w_q.shape)}"
        )
    if w_q.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 GEMV: the weight must be e4m3, got {w_q.dtype}")
    if (x_scale is not None) != (x_q.dtype == FP8_DTYPE):
        raise ValueError(
            f"FP8 GEMV: x of {x_q.dtype} with{'out' if x_scale is None else ''} a scale "
            "(e4m3 x takes a scale a token; bf16 / fp16 / fp32 x none)"
        )
    if x_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError("FP8 GEMV: x and weight must be row-major (contiguous along K)")
    m, n = x_q.shape[0], w_q.shape[0]
    if (x_scale is not None and x_scale.numel() != m) or w_scale.numel() not in (1, n):
        raise ValueError(
            f"FP8 GEMV: scales {None if x_scale is None else tuple(x_scale.shape)}, "
            f"{tuple(w_scale.shape)} do not fit "
            f"{m} tokens and {n} rows (one a token; one a row or one in all)"
        )
    if bias is not None and bias.numel() != n:
        raise ValueError(f"FP8 GEMV: bias of {bias.numel()} values for {n} outputs")


def fp8_gemv(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias -> [M, N] in out_dtype, as
    quant_reference.fp8_rowwise_matmul: x_q [M, K] e4m3 with x_scale [M, 1] fp32, w_q [N, K]
    e4m3 with w_scale [N, 1] (per channel) or a single value (per tensor). With x_scale None,
    x_q is x itself (bf16 / fp16 / fp32, not quantized): x @ (w_q * w_scale)^T, as
    quant_reference.fp8_weight_only_matmul. `config` overrides fp8_gemv_config's pick.
    Meant for M <= FP8_GEMV_MAX_TOKENS."""
    _check(x_q, w_q, x_scale, w_scale, bias)
    m, k = x_q.shape
    n = w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        config = fp8_gemv_config(n, k, sm_count(x_q.device))
    k_split, split_k, even_k = split_layout(k, config.block_k, config.split_k)
    partial = out
    if split_k > 1:
        partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x_q.device)
    w_scale = w_scale.reshape(-1)
    x_scale = x_scale.reshape(m) if x_scale is not None else w_scale  # unused: not X_SCALED
    pdl = pdl_enabled(x_q.device)
    _fp8_gemv_kernel[(m * triton.cdiv(n, config.block_n), split_k)](
        x_q,
        x_scale,
        w_q,
        w_scale,
        bias.contiguous() if bias is not None else w_scale,  # unused without HAS_BIAS
        partial,
        m,
        n,
        k,
        k_split,
        x_q.stride(0),
        x_scale.stride(0),
        w_q.stride(0),
        w_scale.stride(0) if w_scale.numel() == n else 0,  # one scale for all rows
        n,
        m * n,
        HAS_BIAS=bias is not None,
        X_SCALED=x_q.dtype == FP8_DTYPE,
        EVEN_K=even_k,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages,
        PREFETCH_LINES=prefetch_lines(config, max(1, config.block_k // 128)),
        PDL=pdl,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
        **pdl_launch(pdl),
    )
    if split_k > 1:
        sum_splits(partial, out)
    return out
