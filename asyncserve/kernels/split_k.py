"""Shared pieces of the split-K decode GEMVs (kernels/int4_gemv.py, kernels/fp8_gemv.py): the
launch shape, the number of K splits picked from the layer's shape, and the second pass that
adds the splits' fp32 partial sums in a fixed order (deterministic, unlike atomics).

A GEMV's grid is (tokens x output blocks, splits): split s of a program covers K columns
[s * k_split, (s + 1) * k_split) and writes its partial sums to part[s, token, n].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_wait

# Up to this many tokens the GEMVs run (each token reads the weight again, from L2 after the
# first: a GEMV runs a block's tokens side by side); more tokens take the GEMMs.
GEMV_MAX_TOKENS = 4
# Programs per SM the splits aim for: enough loads in flight to stream the weight.
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 16


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: outputs per program, K columns per loop step, K splits, warps, and the
    loop's pipeline depth (loop steps whose loads are in flight at once; 1: none ahead)."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 1
    # Registers a thread may hold (ptxas's maxnreg; None: the compiler's choice), for the
    # GEMV sweeps: caps of 40-56 were slower on every int4 shape on an H200 (spills cost
    # more than the extra programs an SM gained).
    maxnreg: int | None = None
    # 128-byte lines of each weight row a program prefetches into L2 before it waits on the
    # kernel before it (programmatic dependent launch, kernels/pdl.py), from the start of
    # its K slice; None: the kernel's default (the FP8 GEMV: its first loop step's; the
    # int4 GEMV: none); 0: none.
    prefetch_lines: int | None = None


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device; 1 elsewhere (the interpreter), which keeps K whole."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 1


def pick_split_k(
    tiles: int, steps: int, sms: int, programs_per_sm: float = _PROGRAMS_PER_SM
) -> int:
    """K splits for a grid of `tiles` output blocks a token over `steps` loop steps: the
    fewest that give about `programs_per_sm` programs per SM, among the divisors of `steps`
    (every program the same work), at most 16 and at least 2 steps a split."""
    split_k = 1
    for candidate in range(1, min(_MAX_SPLITS, max(1, steps // 2)) + 1):
        if steps % candidate == 0:
            split_k = candidate
            if tiles * candidate >= programs_per_sm * sms:
                break
    return split_k


def prefetch_lines(config: GemvConfig, default_lines: int) -> int:
    """Lines of each weight row a GEMV program prefetches (a power of two, for tl.arange):
    the config's, or the kernel's default (`default_lines`)."""
    lines = default_lines if config.prefetch_lines is None else config.prefetch_lines
    return triton.next_power_of_2(lines) if lines > 0 else 0


def split_layout(k: int, block_k: int, split_k: int) -> tuple[int, int, bool]:
    """(columns a split, splits, even): the splits' K slices in whole steps, none empty;
    `even` when no step runs past K or its split (the kernels skip the K masks)."""
    steps = triton.cdiv(k, block_k)
    k_split = triton.cdiv(steps, split_k) * block_k
    splits = triton.cdiv(k, k_split)
    return k_split, splits, k % k_split == 0 and k_split % block_k == 0


@triton.jit
def gemv_program(m, n, k, k_split, BLOCK_N: tl.constexpr):
    """A GEMV program's share of the grid (tokens x output blocks, splits): its token, its
    BLOCK_N outputs and which of them exist, the weight rows it reads (rows past N re-read
    row N - 1, so loads need no mask along N; only the store is masked), and its K slice.
    Axis 0 runs over tokens first, so the tokens of one block of W run together and read it
    from L2 after the first."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = pid % m
    offs_n = (pid // m) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * k_split
    k_end = tl.minimum(k_start + k_split, k)
    return row, offs_n, offs_n < n, tl.minimum(offs_n, n - 1), pid_k, k_start, k_end


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """out = the sum over splits of part [SPLIT_K, numel], added in split order."""
    pdl_wait(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] (contiguous) = part [splits, M, N] (fp32) summed over splits, in order."""
    numel = out.numel()
    block = 1024
    pdl = pdl_enabled(out.device)
    _sum_splits_kernel[(triton.cdiv(numel, block),)](
        part, out, numel, SPLIT_K=part.shape[0], BLOCK=block, PDL=pdl, **pdl_launch(pdl)
    )
