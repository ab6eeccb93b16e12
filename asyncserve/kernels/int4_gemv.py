"""Triton int4 GEMV for decode (W4A16, one to a few tokens): x [M, K] @ W^T with W in the int4
layout of kernels/quant_reference.py (qweight int32 [N, K / 8], scales / zeros [N, groups],
optional g_idx). At batch 1 a layer's time is the packed bytes read, so the kernel is built
to stream them:

- Per element only unpack + multiply-add: the scale and zero are read once per (output row,
  group) as vectors, and a group adds `scale * (sum q * x - zero * sum x)`, which equals
  sum (q - zero) * scale * x. Symmetric weights (zeros None: every zero 8, as
  compressed-tensors and symmetric GPTQ store them) read no zeros at all, 3% fewer bytes.
- Split-K: programs take a slice of K each (grid: tokens x output blocks, splits), so even a
  4096 x 4096 layer runs several programs per SM; the splits' fp32 partial sums go to a
  [splits, M, N] buffer that a second small kernel adds in a fixed order (deterministic;
  kernels/split_k.py, shared with the FP8 GEMV).
- A program's packed words are read along K (contiguous), each thread a few adjacent words.
- Launched with programmatic dependent launch (kernels/pdl.py). A program can prefetch
  words of its slice into L2 (GemvConfig.prefetch_lines) before it waits for the kernel
  before it (the weight does not depend on that kernel, x does); by default none: on an
  H200 (`int4_gemv_bench.py --sweep --narrow --prefetch 0,4,16,64`) no prefetch was the
  fastest on all four Llama-3-8B shapes, one step's (4 lines) 3-10% slower on three.

Act-order weights (a g_idx) whose groups the layer could not make contiguous (a row-parallel
rank's slice, quantization/int4.py) and group sizes that are not a power of two take a slower
path that reads the scale and zero of every column.
References: quant_reference.int4_matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.activation import gated_activation
from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_prefetch_l2, pdl_wait
from asyncserve.kernels.quant_reference import SYMMETRIC_ZERO as _ZERO
from asyncserve.kernels.split_k import (
    GemvConfig,
    gemv_program,
    pick_split_k,
    prefetch_lines,
    sm_count,
    split_layout,
    sum_splits,
)

__all__ = ["GATED_ACTIVATIONS", "GemvConfig", "gemv_config", "int4_gemv", "whole_group_step"]

# Symmetric weights' zero point, as a constant the kernels can read.
SYMMETRIC_ZERO = tl.constexpr(_ZERO)
# The gated GEMV's activations (the kernel's GATED): none, SiLU, GELU (tanh approximation).
GATED_ACTIVATIONS = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}


def _per_column_groups(g_idx: torch.Tensor | None, group_size: int) -> bool:
    """Whether the scale and zero must be looked up per column (see the module docstring)."""
    return g_idx is not None or group_size & (group_size - 1) != 0


def gemv_config(n: int, k: int, group_size: int, per_column: bool, sms: int) -> GemvConfig:
    """The launch shape for an N x K weight on a GPU of `sms` SMs, from the shape alone.

    block_n 16 x block_k 1024 with 4 warps: a loop step reads 16 rows of 128 words (512
    contiguous bytes a row, 8 KiB a step) and each thread unpacks 128 weights. On an H100
    (benchmarks/int4_gemv_bench.py --sweep, group size 128) it was the fastest tile on all
    four Llama-3-8B shapes: 1,040-2,175 GB/s against 32 x 512's 816-1,628 (the layers' sum
    0.067 against 0.084 ms); 8 warps lose on every shape.
    block_k holds whole groups, or part of one group when groups are larger.
    Then K is split until the grid holds about 4 programs per SM (Hopper's 132 SMs: 528),
    into a divisor of the number of steps (every program the same work), at most 16 splits
    and at least 2 steps a split: Llama-3-8B's layers get qkv 6144 x 4096 -> 2 splits, o
    4096 x 4096 -> 2, gate_up 28672 x 4096 -> 1 (1792 programs), down 4096 x 14336 -> 7 (the
    sweep's best split on three shapes, within 4% on o).
    """
    block_n = 16
    block_k = min(1024, triton.next_power_of_2(k))
    if not per_column:
        block_k = max(block_k, min(group_size, 1024))  # whole groups a step
    split_k = pick_split_k(triton.cdiv(n, block_n), triton.cdiv(k, block_k), sms)
    return GemvConfig(block_n, block_k, split_k)


@triton.jit
def whole_group_step(
    wu,
    x_row,
    k0,
    k_end,
    rows,
    s_ptr,
    z_ptr,
    stride_sn,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr = True,
):
    """One loop step of whole groups: wu [BLOCK_N, BLOCK_K / 8] packed words (uint32) of
    columns k0.. -> [BLOCK_N, BLOCK_K / SUB_K] sums scale * (sum q * x - zero * sum x), one
    per row and group (or part of a group) of the step; without HAS_ZEROS every zero is
    SYMMETRIC_ZERO and z_ptr is not read."""
    WORDS: tl.constexpr = BLOCK_K // 8
    NSUB: tl.constexpr = BLOCK_K // SUB_K
    cols = k0 + tl.arange(0, WORDS) * 8  # first column of each word
    qx = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    xs = tl.zeros([WORDS], dtype=tl.float32)
    for i in tl.static_range(8):
        # Nibble i of each word is column 8j + i (a strided load of x, from L1).
        if EVEN_K:
            xi = tl.load(x_row + cols + i).to(tl.float32)
        else:
            xi = tl.load(x_row + cols + i, mask=cols < k_end, other=0.0).to(tl.float32)
        # q * 16^i is the nibble masked in place, converted exactly; times x / 16^i (exact
        # too, and once per column, not per element) it is q * x. Per element: a mask, a
        # conversion and a multiply-add.
        q_at = (wu & (0xF << (4 * i))).to(tl.float32)
        qx += q_at * (xi * (1.0 / (1 << (4 * i))))[None, :]
        xs += xi
    if NSUB == 1:
        qg = tl.sum(qx, axis=1)[:, None]
        xg = tl.sum(xs, axis=0)
        starts = k0 + tl.arange(0, 1) * SUB_K
    else:
        qg = tl.sum(tl.reshape(qx, [BLOCK_N, NSUB, WORDS // NSUB]), axis=2)
        xg = tl.sum(tl.reshape(xs, [NSUB, WORDS // NSUB]), axis=1)[None, :]
        starts = k0 + tl.arange(0, NSUB) * SUB_K
    s_off = rows[:, None] * stride_sn + (starts // GROUP)[None, :]
    if EVEN_K:
        scale = tl.load(s_ptr + s_off).to(tl.float32)
    else:
        scale = tl.load(s_ptr + s_off, mask=(starts < k_end)[None, :], other=0.0).to(tl.float32)
    if not HAS_ZEROS:
        zero = SYMMETRIC_ZERO
    elif EVEN_K:
        zero = tl.load(z_ptr + s_off).to(tl.float32)
    else:
        zero = tl.load(z_ptr + s_off, mask=(starts < k_end)[None, :], other=0.0).to(tl.float32)
    return scale * (qg - zero * xg)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    gidx_ptr,
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
    PER_COLUMN: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH_LINES: tl.constexpr,
    PDL: tl.constexpr,
    GATED: tl.constexpr = 0,
    HAS_ZEROS: tl.constexpr = True,
):
    """out[split, row, n-block] = the split's K slice of x[row] @ W[n-block]^T (fp32 sums);
    the grid as split_k.gemv_program says. GATED (1 SiLU, 2 GELU-tanh; one split only): W is
    a gated MLP's gate and up halves (n rows) and out[row] = act(gate) * up ([m, n / 2]): a
    program reads BLOCK_N / 2 gate rows and the up rows n / 2 further, interleaved."""
    if GATED:
        row, offs_n, mask_n, half_rows, pid_k, k_start, k_end = gemv_program(
            m, n // 2, k, k_split, BLOCK_N // 2
        )
        rows = tl.reshape(tl.join(half_rows, half_rows + n // 2), [BLOCK_N])
    else:
        row, offs_n, mask_n, rows, pid_k, k_start, k_end = gemv_program(m, n, k, k_split, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, WORDS)
    qw_rows = qw_ptr + rows[:, None] * stride_qn
    x_row = x_ptr + row * stride_xm
    if PREFETCH_LINES > 0:
        # Packed words into L2 while the kernel before still runs (kernels/pdl.py): 32 a line.
        lines = tl.minimum(k_start // 8 + tl.arange(0, PREFETCH_LINES) * 32, (k_end - 1) // 8)
        pdl_prefetch_l2(qw_rows + lines[None, :], PDL)
    pdl_wait(PDL)
    NSUB: tl.constexpr = BLOCK_K // SUB_K
    acc = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offs_w * 8  # first column of each word
        if EVEN_K:
            words = tl.load(qw_rows + (k0 // 8 + offs_w)[None, :])
        else:
            words = tl.load(
                qw_rows + (k0 // 8 + offs_w)[None, :], mask=(cols < k_end)[None, :], other=0
            )
        wu = words.to(tl.uint32, bitcast=True)
        if PER_COLUMN:
            qx = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
            for i in tl.static_range(8):
                # Nibble i of each word is column 8j + i; columns past K (a ragged tail) read
                # group 0 and x 0.
                if EVEN_K:
                    xi = tl.load(x_row + cols + i).to(tl.float32)
                else:
                    xi = tl.load(x_row + cols + i, mask=cols < k_end, other=0.0).to(tl.float32)
                if HAS_GIDX:
                    grp = tl.load(gidx_ptr + cols + i, mask=cols < k_end, other=0)
                else:
                    grp = tl.where(cols < k_end, (cols + i) // GROUP, 0)
                s_off = rows[:, None] * stride_sn + grp[None, :]
                scale = tl.load(s_ptr + s_off).to(tl.float32)
                if HAS_ZEROS:
                    zero = tl.load(z_ptr + s_off).to(tl.float32)
                else:
                    zero = SYMMETRIC_ZERO
                q = ((wu >> (4 * i)) & 0xF).to(tl.float32)
                qx += (q - zero) * scale * xi[None, :]
            acc += tl.sum(qx, axis=1)[:, None]
        else:
            acc += whole_group_step(
                wu, x_row, k0, k_end, rows, s_ptr, z_ptr, stride_sn, GROUP, EVEN_K, BLOCK_N,
                BLOCK_K, SUB_K, HAS_ZEROS,
            )  # fmt: skip
    out = out_ptr + pid_k * stride_osplit + row * stride_om + offs_n
    total = tl.sum(acc, axis=1)
    if GATED:
        # Rounded to the output dtype where the unfused MLP rounds (the gate_up output, the
        # activation), so both give the same values.
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(total.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
        act = gated_activation(gate, GATED == 2).to(dtype).to(tl.float32)
        tl.store(out, (act * up).to(dtype), mask=mask_n)
    else:
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask_n)


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    config: GemvConfig | None = None,
    activation: str | None = None,
    keep_splits: bool = False,
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N] in x's dtype; `config` overrides gemv_config's pick.
    With `activation` ("silu" or "gelu_pytorch_tanh") W is a gated MLP's gate and up halves
    and the result act(gate) * up, [M, N / 2], from one program per output block (no K
    splits). With `keep_splits` the result is the K splits' fp32 partial sums [splits, M, N]
    (one or more), for a consumer that adds them itself (norm.add_parts_rms_norm): no kernel
    of their own. The caller (int4_gemm.int4_matmul) has checked the shapes and strides."""
    m, k = x.shape
    n = qweight.shape[0]
    gated = GATED_ACTIVATIONS[activation]
    if gated and (n % 2 or keep_splits):
        raise ValueError(f"a gated int4 GEMV needs an even number of rows and no splits, got {n}")
    out = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.new_zeros((1, m, n), dtype=torch.float32) if keep_splits else out
    per_column = _per_column_groups(g_idx, group_size)
    if config is None:
        config = gemv_config(n, k, group_size, per_column, sm_count(x.device))
    block_k, split_k = config.block_k, config.split_k
    if gated:
        split_k = 1  # the activation needs whole sums
    if per_column:
        sub_k = block_k
    else:
        sub_k = min(block_k, group_size)
        if block_k % sub_k or (group_size % sub_k and sub_k != block_k):
            raise ValueError(f"int4 GEMV block_k {block_k} does not fit groups of {group_size}")
    k_split, split_k, even_k = split_layout(k, block_k, split_k)
    pdl = pdl_enabled(x.device)
    partial = out
    if split_k > 1 or keep_splits:
        partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    # Gated: block_n / 2 outputs a program (as many programs: cdiv(2d, 2b) = cdiv(d, b)).
    grid = (m * triton.cdiv(n, config.block_n), split_k)
    _int4_gemv_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,  # unused when HAS_ZEROS is False
        g_idx if g_idx is not None else scales,  # unused when HAS_GIDX is False
        partial,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.shape[1],
        m * n,
        GROUP=group_size,
        PER_COLUMN=per_column,
        HAS_GIDX=g_idx is not None,
        EVEN_K=even_k,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        SUB_K=sub_k,
        NUM_STAGES=config.num_stages,
        PREFETCH_LINES=prefetch_lines(config, 0),
        PDL=pdl,
        GATED=gated,
        HAS_ZEROS=zeros is not None,
        num_warps=config.num_warps,
        maxnreg=config.maxnreg,
        **pdl_launch(pdl),
    )
    if keep_splits:
        return partial
    if split_k > 1:
        sum_splits(partial, out)
    return out
