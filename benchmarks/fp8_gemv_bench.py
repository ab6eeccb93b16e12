"""The FP8 GEMV (W8A8 decode) on Llama-3-8B's linear shapes, against the previous route
(per-token quantization + torch._scaled_mm with row-wise scales) and the bf16 torch.matmul.

For each shape and --m tokens: device time per call (a CUDA graph of 20 calls replayed;
CUDA events, median of --reps replays after a warm-up), with the weights rotated over copies
larger than L2 so each call reads its weight from memory as a decode step does; and the
bandwidth against the e4m3 weight's bytes (N x K). Timed: `gemv` (the per-token quantization
kernel + the GEMV, what quantization/fp8.py now runs), `gemv_only` (the GEMV on quantized x),
`scaled_mm` (the quantization kernel + torch._scaled_mm, the previous route) and `bf16`.
The GEMV's output is checked against quant_reference first. --sweep also times a grid of
launch shapes. Results as JSON lines on stdout and in $OUT/fp8_gemv_m{M}.json.
Usage: OUT=/tmp/out python benchmarks/fp8_gemv_bench.py [--m 1] [--sweep]
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

# The repository root: `python benchmarks/X.py` imports benchmarks.* as well.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.fp8_gemm import per_token_group_quant_fp8  # noqa: E402
from asyncserve.kernels.fp8_gemv import fp8_gemv, fp8_gemv_config  # noqa: E402
from asyncserve.kernels.split_k import GemvConfig  # noqa: E402
from benchmarks.graph_timing import time_ms  # noqa: E402

# Llama-3-8B: fused qkv, o, fused gate_up, down as (N, K).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
ROTATE_BYTES = 256 << 20  # weight copies per shape: at least this many bytes (L2 is 50 MiB)
Weight = tuple[torch.Tensor, torch.Tensor]


def make_weight(n: int, k: int, seed: int, device: torch.device) -> Weight:
    """A random e4m3 weight [N, K] and its fp32 row scales [N, 1]."""
    g = torch.Generator(device=device).manual_seed(seed)
    w_q = (torch.randn(n, k, device=device, generator=g) * 64).to(reference.FP8_DTYPE)
    scale = torch.rand(n, 1, device=device, generator=g) * 1e-3 + 1e-4
    return w_q, scale


def gemv_route(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """What quantization/fp8._rowwise_scaled_mm runs for a few tokens."""
    x_q, x_s = per_token_group_quant_fp8(x, x.shape[1])
    return fp8_gemv(x_q, w[0], x_s, w[1], x.dtype)


def scaled_mm_route(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The previous route: the same quantization, then cuBLASLt's row-wise scaled GEMM."""
    x_q, x_s = per_token_group_quant_fp8(x, x.shape[1])
    return torch._scaled_mm(x_q, w[0].t(), scale_a=x_s, scale_b=w[1].t(), out_dtype=torch.bfloat16)


def check(n: int, k: int, m: int, device: torch.device) -> float:
    """Max abs error of the GEMV route against quant_reference (bf16 x), relative to the
    reference's largest output; raises when it exceeds bf16 rounding."""
    w = make_weight(n, k, 0, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = gemv_route(x, w).float()
    x_q, x_s = reference.per_token_group_quant_fp8(x, k)
    ref = reference.fp8_rowwise_matmul(x_q, w[0], x_s, w[1], torch.float32)
    err = float((out - ref).abs().max() / ref.abs().max())
    if err > 1e-2:
        raise AssertionError(f"FP8 GEMV {n} x {k} differs from the reference: {err:.3g}")
    return err


def gb_s(nbytes: int, ms: float) -> float:
    return round(nbytes / ms / 1e6, 1)


def bench_shape(n: int, k: int, m: int, reps: int, sms: int, cuda: torch.device) -> dict:
    err = check(n, k, m, cuda)
    nbytes = n * k  # e4m3 weight
    copies = max(2, -(-ROTATE_BYTES // nbytes))
    weights = [make_weight(n, k, seed, cuda) for seed in range(copies)]
    x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
    x_q, x_s = per_token_group_quant_fp8(x, k)
    gemv_ms = time_ms([lambda w=w: gemv_route(x, w) for w in weights], reps)
    only_ms = time_ms([lambda w=w: fp8_gemv(x_q, w[0], x_s, w[1], x.dtype) for w in weights], reps)
    mm_ms = time_ms([lambda w=w: scaled_mm_route(x, w) for w in weights], reps)
    del weights
    bf16_copies = max(2, -(-ROTATE_BYTES // (2 * nbytes)))
    dense = [torch.randn(n, k, device=cuda, dtype=torch.bfloat16) for _ in range(bf16_copies)]
    bf16_ms = time_ms([lambda w=w: x @ w.t() for w in dense], reps)
    del dense
    return {
        "n": n,
        "k": k,
        "m": m,
        "config": dataclasses.asdict(fp8_gemv_config(n, k, sms)),
        "rel_err": err,
        "gemv_ms": round(gemv_ms, 4),
        "gemv_only_ms": round(only_ms, 4),
        "scaled_mm_ms": round(mm_ms, 4),
        "bf16_ms": round(bf16_ms, 4),
        "gemv_gb_s": gb_s(nbytes, gemv_ms),
        "gemv_only_gb_s": gb_s(nbytes, only_ms),
        "scaled_mm_gb_s": gb_s(nbytes, mm_ms),
        "bf16_gb_s": gb_s(2 * nbytes, bf16_ms),
    }


def sweep(
    n: int, k: int, m: int, reps: int, cuda: torch.device, stages: tuple[int, ...], narrow: bool
) -> list[dict]:
    """The GEMV alone (x quantized) under a grid of launch shapes, each at every pipeline
    depth in `stages` (narrow: around the default tile only); prints each and the best."""
    copies = max(2, -(-ROTATE_BYTES // (n * k)))
    weights = [make_weight(n, k, seed, cuda) for seed in range(copies)]
    x_q, x_s = per_token_group_quant_fp8(torch.randn(m, k, device=cuda), k)
    rows = []
    if narrow:
        grid = itertools.product((8, 16), (512, 1024), (1, 2), (4,), stages)
    else:
        grid = itertools.product((8, 16, 32), (256, 512, 1024), (1, 2, 4, 7, 8), (4, 8), stages)
    for block_n, block_k, split_k, warps, depth in grid:
        if k // block_k < split_k or block_n * block_k > 128 * 32 * warps:
            continue  # empty splits, or over 128 accumulators a thread (spills)
        config = GemvConfig(block_n, block_k, split_k, warps, depth)
        fns = [
            lambda w=w, c=config: fp8_gemv(x_q, w[0], x_s, w[1], torch.bfloat16, None, c)
            for w in weights
        ]
        ms = time_ms(fns, reps // 2)
        row = {"n": n, "k": k, "sweep": dataclasses.asdict(config), "ms": round(ms, 4)}
        row["gb_s"] = gb_s(n * k, ms)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"best": min(rows, key=lambda r: r["ms"])}), flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--m", type=int, default=1, help="tokens (1 to 4)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs")
    parser.add_argument("--narrow", action="store_true", help="sweep only around the default tile")
    parser.add_argument(
        "--stages", default="1", help="loop pipeline depths the sweep tries, e.g. 1,2,3,4"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.m <= 4:
        parser.error("--m must be 1 to 4 (the GEMV's batch sizes)")
    return args


def main() -> None:
    args = parse_args()
    stages = tuple(int(s) for s in args.stages.split(","))
    cuda = torch.device("cuda")
    sms = torch.cuda.get_device_properties(cuda).multi_processor_count
    print(json.dumps({"device": torch.cuda.get_device_name(cuda), "sms": sms}), flush=True)
    results, summary = [], []
    for n, k in SHAPES:
        row = bench_shape(n, k, args.m, args.reps, sms, cuda)
        print(json.dumps(row), flush=True)
        results.append(row)
        summary.append(row)
        if args.sweep:
            rows = sweep(n, k, args.m, args.reps, cuda, stages, args.narrow)
            results += rows
            summary.append({"best": min(rows, key=lambda r: r["ms"])})
    for row in summary:  # again at the end, where a log's tail shows them
        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fp8_gemv_m{args.m}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
