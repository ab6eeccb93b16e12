"""The int4 GEMMs (W4A16 prompts and batches past the GEMV) on Llama-3-8B's linear shapes,
group 128: the whole-group GEMM at its default tile, the per-column dequant-GEMM (the path
every int4 layer took before), and the bf16 torch.matmul, at several token counts; --sweep
also times a grid of whole-group tiles at each.

Device time per call as int4_gemv_bench.py measures it (a CUDA graph of 20 calls over weight
copies larger than L2; median of --reps replays). Outputs are checked against
quant_reference first. JSON lines on stdout and in $OUT/int4_gemm.json.
At up to GEMV_MAX_TOKENS tokens the default row (group_ms) is the GEMV, which int4_matmul
takes there; `--sweep --split --m 1 4 16 128` times the whole-group GEMM with K splits beside it.
Usage: OUT=/tmp/out python benchmarks/int4_gemm_bench.py [--m 16 128 1024] [--sweep [--split]]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.int4_gemm import (  # noqa: E402
    GroupGemmConfig,
    _int4_gemm_kernel,
    group_gemm_config,
    int4_group_gemm,
    int4_matmul,
)
from asyncserve.kernels.split_k import sm_count  # noqa: E402
from benchmarks.graph_timing import time_ms  # noqa: E402
from benchmarks.int4_gemv_bench import GROUP, ROTATE_BYTES, SHAPES, make_weight  # noqa: E402

CUDA = torch.device("cuda")
SPLITS = (1, 2, 4, 8, 16)


def per_column_gemm(x: torch.Tensor, qweight: torch.Tensor, s: torch.Tensor, z: torch.Tensor):  # type: ignore[no-untyped-def]
    """The per-column dequant-GEMM at the tile int4_matmul gives it."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, 64))](
        x, qweight, s, z, s, out, m, n, k, x.stride(0), qweight.stride(0), s.stride(0),
        out.stride(0), GROUP=GROUP, HAS_GIDX=False, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
        IEEE_DOT=False,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--split", action="store_true", help="sweep few-token tiles with K splits (with --sweep)"
    )
    parser.add_argument("--no-per-column", action="store_true", help="skip the old kernel")
    parser.add_argument("--variants", action="store_true", help="the layout experiments only")
    parser.add_argument(
        "--which", type=int, nargs="+", default=[0, 1, 2, 3], help="variants (0: this kernel)"
    )
    args = parser.parse_args()
    if args.variants:
        variants(args.m, args.reps, tuple(args.which))
        return
    print(json.dumps({"device": torch.cuda.get_device_name(CUDA)}), flush=True)
    results = []
    for (n, k), m in itertools.product(SHAPES, args.m):
        nbytes = n * k // 2 + 2 * n * (k // GROUP) * 2
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        weights = [make_weight(n, k, seed) for seed in range(copies)]
        x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
        ref = reference.int4_matmul(x.float(), *weights[0], None, GROUP)
        err = float((int4_matmul(x, *weights[0], None, GROUP).float() - ref).abs().max())
        err /= float(ref.abs().max())
        assert err < 1e-2, f"{n} x {k} at {m} tokens differs from the reference: {err:.3g}"
        flops = 2 * m * n * k
        row = {"n": n, "k": k, "m": m, "rel_err": round(err, 5)}
        row["config"] = dataclasses.asdict(group_gemm_config(m, n, GROUP, k, sm_count(CUDA)))
        row["group_ms"] = time_ms(
            [lambda w=w, x=x: int4_matmul(x, *w, None, GROUP) for w in weights], args.reps
        )
        if not args.no_per_column:
            row["per_column_ms"] = time_ms(
                [lambda w=w, x=x: per_column_gemm(x, *w) for w in weights], args.reps
            )
        dense = [
            torch.randn(n, k, device=CUDA, dtype=torch.bfloat16)
            for _ in range(max(2, -(-ROTATE_BYTES // (2 * n * k))))
        ]
        row["bf16_ms"] = time_ms([lambda w=w, x=x: x @ w.t() for w in dense], args.reps)
        del dense
        for key in ("group_ms", "per_column_ms", "bf16_ms"):
            if key in row:
                row[key.replace("_ms", "_tflops")] = round(flops / row[key] / 1e9, 1)
                row[key] = round(row[key], 4)
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.sweep:
            results += sweep(x, weights, n, k, m, args.reps, args.split)
        del weights
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_gemm.json").write_text(json.dumps(results, indent=1))


def sweep_grid(m: int, split: bool) -> Iterator[GroupGemmConfig]:
    """Tiles to time at m tokens; with `split`, the few-token grid: narrow N tiles, deeper
    pipelines and K splits (1-16)."""
    if split:
        block_m = min(64, max(16, triton.next_power_of_2(m)))
        for block_n, stages, split_k in itertools.product((16, 32, 64, 128), (3, 5), SPLITS):
            yield GroupGemmConfig(block_m, block_n, 128, 4, stages, split_k)
        return
    block_ms = sorted(
        {min(64, max(16, triton.next_power_of_2(m))), min(128, max(16, triton.next_power_of_2(m)))}
    )
    for block_m, block_n, block_k, warps, stages in itertools.product(
        block_ms, (64, 128), (64, 128), (4, 8), (3, 4)
    ):
        yield GroupGemmConfig(block_m, block_n, block_k, warps, stages)


Weight = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def sweep(
    x: torch.Tensor, weights: list[Weight], n: int, k: int, m: int, reps: int, split: bool
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    ref = reference.int4_matmul(x.float(), *weights[0], None, GROUP)
    for config in sweep_grid(m, split):
        out = torch.empty((m, n), dtype=x.dtype, device=CUDA)
        try:
            int4_group_gemm(x, *weights[0], GROUP, out, config)
            err = float((out.float() - ref).abs().max() / ref.abs().max())
            assert err < 1e-2, f"{config} differs from the reference: {err:.3g}"
            fns = [
                lambda w=w, c=config, o=out: int4_group_gemm(x, *w, GROUP, o, c) for w in weights
            ]
            ms = time_ms(fns, reps // 2)
        except Exception as exc:  # noqa: BLE001  (a tile past shared memory)
            print(json.dumps({"config": dataclasses.asdict(config), "error": str(exc)[:80]}))
            continue
        row = {"n": n, "k": k, "m": m, "sweep": dataclasses.asdict(config), "ms": round(ms, 4)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if rows:
        print(json.dumps({"best": min(rows, key=lambda r: r["ms"])}), flush=True)
    return rows


# --- Layout experiments: the whole-group GEMM with its nibbles unpacked without the reshape
# (VARIANT 1: eight dots of K / 8 columns, nibble i of each word against x's columns 8j + i;
# VARIANT 2: one dot over K permuted nibble-major, each word loaded once per nibble).
@triton.jit
def _variant_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, m, n, k, stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    VARIANT: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    rows = tl.minimum(offs_n, n - 1)
    W: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, W)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    shifts = tl.arange(0, 8) * 4
    for k0 in range(0, k, BLOCK_K):
        if VARIANT == 3:
            words = tl.load(qw_ptr + rows[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :])
            q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, [BLOCK_N, BLOCK_K])
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mask_m[:, None], other=0.0
            )
            part_t = tl.dot(q.to(x.dtype), tl.trans(x))
            x_sum = tl.sum(x.to(tl.float32), axis=1)
        elif VARIANT == 1:
            words = tl.load(qw_ptr + rows[:, None] * stride_qn + (k0 // 8 + offs_w)[None, :])
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for i in tl.static_range(8):
                cols = k0 + offs_w * 8 + i
                xi = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                    mask=mask_m[:, None],
                    other=0.0,
                )
                qi = ((words >> (4 * i)) & 0xF).to(xi.dtype)
                part = tl.dot(xi, tl.trans(qi), part)
                x_sum += tl.sum(xi.to(tl.float32), axis=1)
        else:
            c = tl.arange(0, BLOCK_K)
            j = c % W
            i = c // W
            words = tl.load(qw_ptr + rows[:, None] * stride_qn + (k0 // 8 + j)[None, :])
            q = (words >> (4 * i)[None, :]) & 0xF
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + (k0 + j * 8 + i)[None, :],
                mask=mask_m[:, None],
                other=0.0,
            )
            part = tl.dot(x, tl.trans(q.to(x.dtype)))
            x_sum = tl.sum(x.to(tl.float32), axis=1)
        group = rows * stride_sn + k0 // GROUP
        scale = tl.load(s_ptr + group).to(tl.float32)
        zero = tl.load(z_ptr + group).to(tl.float32)
        if VARIANT == 3:
            acc_t += part_t * scale[:, None] - (zero * scale)[:, None] * x_sum[None, :]
        else:
            acc += part * scale[None, :] - x_sum[:, None] * (zero * scale)[None, :]
    if VARIANT == 3:
        out_t = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        mask_t = mask_m[None, :] & (offs_n < n)[:, None]
        tl.store(out_t, acc_t.to(out_ptr.dtype.element_ty), mask=mask_t)
    else:
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & (offs_n < n)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def variant_gemm(x, qweight, s, z, variant: int, config: GroupGemmConfig):  # type: ignore[no-untyped-def]
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _variant_kernel[grid](
        x, qweight, s, z, out, m, n, k, x.stride(0), qweight.stride(0), s.stride(0), out.stride(0),
        GROUP=GROUP, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        VARIANT=variant, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def variants(ms: list[int], reps: int, which: tuple[int, ...] = (0, 1, 2, 3)) -> None:
    """Each variant against the reshape kernel, a few tiles each, on every shape."""
    for (n, k), m in itertools.product(SHAPES, ms):
        nbytes = n * k // 2 + 2 * n * (k // GROUP) * 2
        weights = [make_weight(n, k, seed) for seed in range(max(2, -(-ROTATE_BYTES // nbytes)))]
        x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
        ref = int4_matmul(x, *weights[0], None, GROUP).float()
        bms = sorted(
            {
                min(64, max(16, triton.next_power_of_2(m))),
                min(128, max(16, triton.next_power_of_2(m))),
            }
        )
        for variant, bm, (block_n, warps, stages) in itertools.product(
            which, bms, ((64, 4, 3), (128, 4, 3), (64, 8, 4), (128, 8, 3), (128, 4, 4), (256, 8, 3))
        ):
            if variant != 3 and block_n == 256:
                continue
            config = GroupGemmConfig(bm, block_n, 128, warps, stages)
            if variant == 0:
                fn = lambda w, c=config, x=x: int4_matmul(x, *w, None, GROUP, c)  # noqa: E731
            else:
                fn = lambda w, c=config, v=variant, x=x: variant_gemm(x, *w, v, c)  # noqa: E731
            try:
                err = float((fn(weights[0]).float() - ref).abs().max() / ref.abs().max())
                ms_ = time_ms([lambda w=w, f=fn: f(w) for w in weights], reps)
            except Exception as exc:  # noqa: BLE001
                print(json.dumps({"variant": variant, "error": str(exc)[:100]}), flush=True)
                continue
            row = {"n": n, "k": k, "m": m, "variant": variant, "config": dataclasses.asdict(config)}
            row.update(ms=round(ms_, 4), rel_err=round(err, 5))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
