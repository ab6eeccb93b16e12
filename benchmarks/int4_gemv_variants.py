"""Layout experiments for the int4 GEMV (one token, group 128, Llama-3-8B's shapes), each
against kernels/int4_gemv.py at the same launch shape:
- VARIANT 1: x read as [words, 8] tiles (one 16-byte load a word) and its eight columns
  taken apart in registers (tl.split), instead of eight strided 2-byte loads a word;
- VARIANT 2: as 1, with the next step's words loaded before this step's arithmetic.
Timing as int4_gemv_bench.py (CUDA graph of 20 calls over weight copies larger than L2).
Usage: python benchmarks/int4_gemv_variants.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels.int4_gemv import GemvConfig, gemv_config, int4_gemv  # noqa: E402
from asyncserve.kernels.split_k import gemv_program, sm_count, split_layout, sum_splits  # noqa: E402
from benchmarks.graph_timing import time_ms  # noqa: E402
from benchmarks.int4_gemv_bench import GROUP, ROTATE_BYTES, SHAPES, make_weight  # noqa: E402

CUDA = torch.device("cuda")


@triton.jit
def _columns(x8):
    """[W, 8] -> its eight columns, each [W] (register splits, no data movement)."""
    x222 = tl.reshape(x8, [x8.shape[0], 2, 2, 2])
    lo, hi = tl.split(x222)  # column bit 0
    lo0, lo1 = tl.split(lo)  # bit 1
    hi0, hi1 = tl.split(hi)
    c0, c4 = tl.split(lo0)  # bit 2
    c2, c6 = tl.split(lo1)
    c1, c5 = tl.split(hi0)
    c3, c7 = tl.split(hi1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _step(wu, x8, qx):
    c0, c1, c2, c3, c4, c5, c6, c7 = _columns(x8)
    qx += (wu & 0xF).to(tl.float32) * c0[None, :]
    qx += (wu & 0xF0).to(tl.float32) * (c1 * (1.0 / 16))[None, :]
    qx += (wu & 0xF00).to(tl.float32) * (c2 * (1.0 / 256))[None, :]
    qx += (wu & 0xF000).to(tl.float32) * (c3 * (1.0 / 4096))[None, :]
    qx += (wu & 0xF0000).to(tl.float32) * (c4 * (1.0 / 65536))[None, :]
    qx += (wu & 0xF00000).to(tl.float32) * (c5 * (1.0 / 1048576))[None, :]
    qx += (wu & 0xF000000).to(tl.float32) * (c6 * (1.0 / 16777216))[None, :]
    qx += (wu & 0xF0000000).to(tl.float32) * (c7 * (1.0 / 268435456))[None, :]
    return qx


@triton.jit
def _variant_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, m, n, k, k_split, stride_xm, stride_qn, stride_sn,
    stride_om, stride_osplit, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, VARIANT: tl.constexpr,
):  # fmt: skip
    row, offs_n, mask_n, rows, pid_k, k_start, k_end = gemv_program(m, n, k, k_split, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // 8
    NSUB: tl.constexpr = BLOCK_K // GROUP
    offs_w = tl.arange(0, WORDS)
    offs_8 = tl.arange(0, 8)
    qw_rows = qw_ptr + rows[:, None] * stride_qn
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
    if VARIANT == 2:
        words = tl.load(qw_rows + (k_start // 8 + offs_w)[None, :])
    for k0 in range(k_start, k_end, BLOCK_K):
        if VARIANT == 2:
            nxt = k0 + BLOCK_K
            ahead = tl.load(
                qw_rows + (nxt // 8 + offs_w)[None, :],
                mask=(nxt + offs_w * 0 < k_end)[None, :],
                other=0,
            )
        else:
            words = tl.load(qw_rows + (k0 // 8 + offs_w)[None, :])
        x8 = tl.load(x_row + k0 + offs_w[:, None] * 8 + offs_8[None, :]).to(tl.float32)
        wu = words.to(tl.uint32, bitcast=True)
        qx = _step(wu, x8, tl.zeros([BLOCK_N, WORDS], dtype=tl.float32))
        xs = tl.sum(x8, axis=1)
        qg = tl.sum(tl.reshape(qx, [BLOCK_N, NSUB, WORDS // NSUB]), axis=2)
        xg = tl.sum(tl.reshape(xs, [NSUB, WORDS // NSUB]), axis=1)[None, :]
        starts = k0 + tl.arange(0, NSUB) * GROUP
        s_off = rows[:, None] * stride_sn + (starts // GROUP)[None, :]
        scale = tl.load(s_ptr + s_off).to(tl.float32)
        zero = tl.load(z_ptr + s_off).to(tl.float32)
        acc += scale * (qg - zero * xg)
        if VARIANT == 2:
            words = ahead
    out = out_ptr + pid_k * stride_osplit + row * stride_om + offs_n
    tl.store(out, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask_n)


def variant_gemv(x, qweight, scales, zeros, variant: int, config: GemvConfig):  # type: ignore[no-untyped-def]
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_split, split_k, even_k = split_layout(k, config.block_k, config.split_k)
    assert even_k and config.block_k % GROUP == 0
    partial = out if split_k == 1 else torch.empty((split_k, m, n), device=x.device)
    _variant_kernel[(m * triton.cdiv(n, config.block_n), split_k)](
        x, qweight, scales, zeros, partial, m, n, k, k_split, x.stride(0), qweight.stride(0),
        scales.stride(0), n, m * n, GROUP=GROUP, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, VARIANT=variant, num_warps=config.num_warps,
    )  # fmt: skip
    if split_k > 1:
        sum_splits(partial, out)
    return out


def main() -> None:
    sms = sm_count(CUDA)
    for n, k in SHAPES:
        nbytes = n * k // 2 + 2 * n * (k // GROUP) * 2
        weights = [make_weight(n, k, seed) for seed in range(max(2, -(-ROTATE_BYTES // nbytes)))]
        x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
        ref = int4_gemv(x, *weights[0], None, GROUP).float()
        base = gemv_config(n, k, GROUP, False, sms)
        configs = [
            base,
            GemvConfig(32, base.block_k, base.split_k),
            GemvConfig(16, 2048 if k >= 8192 else 1024, max(1, base.split_k // 2)),
        ]
        for config in configs:
            for variant in (0, 1, 2):
                if variant == 0:
                    fn = lambda w, c=config, x=x: int4_gemv(x, *w, None, GROUP, c)  # noqa: E731
                else:
                    fn = lambda w, c=config, v=variant, x=x: variant_gemv(x, *w, v, c)  # noqa: E731
                try:
                    err = float((fn(weights[0]).float() - ref).abs().max() / ref.abs().max())
                    ms = time_ms([lambda w=w, f=fn: f(w) for w in weights], 100)
                except Exception as exc:  # noqa: BLE001
                    print(json.dumps({"variant": variant, "error": str(exc)[:300]}), flush=True)
                    continue
                row = {
                    "n": n,
                    "k": k,
                    "variant": variant,
                    "config": [config.block_n, config.block_k, config.split_k],
                }
                row.update(ms=round(ms, 4), gb_s=round(nbytes / ms / 1e6), rel_err=round(err, 5))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
