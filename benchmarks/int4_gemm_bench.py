"""The int4 GEMMs (W4A16 prompts and batches past the GEMV) on Llama-3-8B's linear shapes,
group 128: the whole-group GEMM at its default tile, the per-column dequant-GEMM (the path
every int4 layer took before), and the bf16 torch.matmul, at several token counts; --sweep
also times a grid of whole-group tiles at each.

Device time per call as int4_gemv_bench.py measures it (a CUDA graph of 20 calls over weight
copies larger than L2; median of --reps replays). Outputs are checked against
quant_reference first. JSON lines on stdout and in $OUT/int4_gemm.json.
Usage: OUT=/tmp/out python benchmarks/int4_gemm_bench.py [--m 16 128 1024] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.int4_gemm import (  # noqa: E402
    GroupGemmConfig,
    _int4_gemm_kernel,
    group_gemm_config,
    int4_matmul,
)
from benchmarks.graph_timing import time_ms  # noqa: E402
from benchmarks.int4_gemv_bench import GROUP, ROTATE_BYTES, SHAPES, make_weight  # noqa: E402

CUDA = torch.device("cuda")


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
    parser.add_argument("--no-per-column", action="store_true", help="skip the old kernel")
    args = parser.parse_args()
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
        row["config"] = dataclasses.asdict(group_gemm_config(m, GROUP))
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
            results += sweep(x, weights, n, k, m, args.reps)
        del weights
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_gemm.json").write_text(json.dumps(results, indent=1))


def sweep(x: torch.Tensor, weights: list, n: int, k: int, m: int, reps: int) -> list[dict]:  # type: ignore[type-arg]
    rows = []
    block_ms = sorted(
        {min(64, max(16, triton.next_power_of_2(m))), min(128, max(16, triton.next_power_of_2(m)))}
    )
    grid = itertools.product(block_ms, (64, 128), (64, 128), (4, 8), (3, 4))
    for block_m, block_n, block_k, warps, stages in grid:
        config = GroupGemmConfig(block_m, block_n, block_k, warps, stages)
        try:
            fns = [lambda w=w, c=config: int4_matmul(x, *w, None, GROUP, c) for w in weights]
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


if __name__ == "__main__":
    main()
