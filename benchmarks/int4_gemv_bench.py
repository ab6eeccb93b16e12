"""The int4 GEMV (W4A16 decode) on Llama-3-8B's linear shapes, group 128, against the previous
GEMV (a copy below) and the bf16 torch.matmul.

For each shape: device time per call (a CUDA graph of 20 calls replayed; CUDA events, median
of --reps replays after a warm-up), with the weights rotated over copies larger than L2 so each
call reads its weight from memory as a decode step does; and the bandwidth against the bytes
the int4 kernels read (packed weight + scales + zeros). The new kernel's output is checked
against quant_reference on the GPU first. --sweep also times a grid of launch shapes.
Results as JSON lines on stdout and in $OUT/int4_gemv.json.
--symmetric times weights without zeros (every zero 8, as compressed-tensors stores them: the
kernels read no zeros); --shapes times other N x K shapes than Llama-3-8B's.
Usage: OUT=/tmp/out python benchmarks/int4_gemv_bench.py [--m 1] [--symmetric]
       [--shapes 28672x4096,...] [--sweep [--narrow] [--stages 1,2,3,4] [--prefetch 0,4,16,64]]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl

# The repository root: `python benchmarks/X.py` imports benchmarks.* as well.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.int4_gemm import _dequant_tile  # noqa: E402
from asyncserve.kernels.int4_gemv import GemvConfig, gemv_config, int4_gemv  # noqa: E402
from asyncserve.kernels.split_k import sm_count  # noqa: E402
from benchmarks.graph_timing import time_ms  # noqa: E402

CUDA = torch.device("cuda")
# Llama-3-8B: fused qkv, o, fused gate_up, down as (N, K).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GROUP = 128
ROTATE_BYTES = 256 << 20  # weight copies per shape: at least this many bytes (L2 is 50 MiB)


# --- The previous GEMV, kept here for comparison: one program per 32 outputs and token,
# all of K in steps of 256, a scale and a zero loaded per weight element (the dequant-GEMM's
# tile, without g_idx).
@triton.jit
def _old_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, n, k, stride_xm, stride_qn, stride_sn, stride_om,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < k, other=0.0).to(tl.float32)
        w = _dequant_tile(
            qw_ptr, s_ptr, z_ptr, s_ptr, offs_n, mask_n, k0, k, stride_qn, stride_sn, GROUP,
            False, BLOCK_N, BLOCK_K, True,
        )  # fmt: skip
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def old_gemv(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _old_gemv_kernel[(triton.cdiv(n, 32), m)](
        x, qweight, scales, zeros, out, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0), GROUP=GROUP, BLOCK_N=32, BLOCK_K=256,
    )  # fmt: skip
    return out


def make_weight(
    n: int, k: int, seed: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A random int4 weight in the layout of quant_reference, on the GPU: asymmetric zeros,
    or none (symmetric)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    values = torch.randint(0, 16, (n, k), device=CUDA, generator=g)
    scales = (torch.rand(n, k // GROUP, device=CUDA, generator=g) * 0.02).bfloat16()
    zeros = torch.randint(0, 16, (n, k // GROUP), device=CUDA, generator=g).bfloat16()
    return reference.pack_int4(values), scales, None if symmetric else zeros


def weight_bytes(n: int, k: int, symmetric: bool = False) -> int:
    """What the int4 kernels read of an N x K weight: packed words, bf16 scales (and zeros)."""
    return n * k // 2 + (1 if symmetric else 2) * n * (k // GROUP) * 2


def rotated_weights(n: int, k: int) -> tuple[list[tuple[torch.Tensor, ...]], int]:
    """Copies of a random N x K weight holding at least ROTATE_BYTES together (a call then
    reads its weight from memory, not L2), and the bytes of one (packed words, scales,
    zeros)."""
    nbytes = n * k // 2 + 2 * n * (k // GROUP) * 2
    return [make_weight(n, k, seed) for seed in range(max(2, -(-ROTATE_BYTES // nbytes)))], nbytes


@dataclasses.dataclass
class OneTokenCase:
    """A Llama-3-8B shape at one token: its rotated weights (rotated_weights), x, int4_gemv's
    output on the first weight and its launch config, the GPU's SMs."""

    n: int
    k: int
    weights: list[tuple[torch.Tensor, ...]]
    nbytes: int
    x: torch.Tensor
    ref: torch.Tensor
    base: GemvConfig
    sms: int


def experiment_cases(check: Callable[[torch.device], bool]) -> Iterator[OneTokenCase]:
    """A GEMV experiment's command line: with --check, `check` on the GPU (or on the CPU
    under TRITON_INTERPRET=1) and exit with its verdict; else each shape's case to time."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="correctness only (small shapes)")
    if parser.parse_args().check:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        sys.exit(0 if check(device) else 1)
    print(json.dumps({"device": torch.cuda.get_device_name(CUDA)}), flush=True)
    for n, k in SHAPES:
        weights, nbytes = rotated_weights(n, k)
        x = torch.randn(1, k, device=CUDA, dtype=torch.bfloat16)
        ref = int4_gemv(x, *weights[0], None, GROUP).float()
        sms = sm_count(CUDA)
        yield OneTokenCase(n, k, weights, nbytes, x, ref, gemv_config(n, k, GROUP, False, sms), sms)


def check(n: int, k: int, m: int, symmetric: bool = False) -> float:
    """Max abs error of the new GEMV against quant_reference (bf16 x), relative to the
    reference's largest output; raises when it exceeds bf16 rounding."""
    qweight, scales, zeros = make_weight(n, k, 0, symmetric)
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    out = int4_gemv(x, qweight, scales, zeros, None, GROUP).float()
    ref = reference.int4_matmul(x.float(), qweight, scales, zeros, None, GROUP)
    err = float((out - ref).abs().max() / ref.abs().max())
    if err > 1e-2:
        raise AssertionError(f"int4 GEMV {n} x {k} differs from the reference: {err:.3g}")
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1, help="tokens (1 to 4)")
    parser.add_argument("--symmetric", action="store_true", help="weights without zeros")
    parser.add_argument(
        "--shapes", default="", help="N x K shapes, e.g. 28672x4096 (default: Llama-3-8B's)"
    )
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configs")
    parser.add_argument(
        "--narrow", action="store_true", help="sweep only around each shape's default tile"
    )
    parser.add_argument(
        "--stages", default="1", help="loop pipeline depths the sweep tries, e.g. 1,2,3,4"
    )
    parser.add_argument(
        "--maxnreg",
        default="0",
        help="registers a thread the sweep allows, e.g. 0,40,48 (0: the compiler's choice)",
    )
    parser.add_argument(
        "--block-k",
        default="512,1024,2048",
        help="K columns a loop step the narrow sweep tries (4096: Llama-3-8B's whole K of "
        "4096 in one step, every weight load of a program issued at once)",
    )
    parser.add_argument("--warps", default="4", help="warps a program the narrow sweep tries")
    parser.add_argument(
        "--prefetch",
        default="",
        help="weight lines a row the sweep prefetches before the PDL wait, e.g. 0,4,16,64 "
        "(default: the kernel's, none)",
    )
    args = parser.parse_args()
    stages = tuple(int(s) for s in args.stages.split(","))
    regs = tuple(int(r) or None for r in args.maxnreg.split(","))
    prefetch = tuple(int(p) for p in args.prefetch.split(",")) if args.prefetch else (None,)
    block_ks = tuple(int(b) for b in args.block_k.split(","))
    warps = tuple(int(w) for w in args.warps.split(","))
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    print(json.dumps({"device": torch.cuda.get_device_name(CUDA), "sms": sms}), flush=True)
    results = []
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]  # type: ignore[misc]
    sym = args.symmetric
    for n, k in shapes:
        err = check(n, k, args.m, sym)
        nbytes = weight_bytes(n, k, sym)
        copies = max(2, -(-ROTATE_BYTES // nbytes))
        weights = [make_weight(n, k, seed, sym) for seed in range(copies)]
        x = torch.randn(args.m, k, device=CUDA, dtype=torch.bfloat16)
        config = gemv_config(n, k, GROUP, False, sms)
        new_ms = time_ms(
            [lambda w=w, x=x: int4_gemv(x, *w, None, GROUP) for w in weights], args.reps
        )
        # The previous GEMV reads zeros: given eights for symmetric weights.
        olds = [(q, s, z if z is not None else torch.full_like(s, 8.0)) for q, s, z in weights]
        old_ms = time_ms([lambda w=w, x=x: old_gemv(x, *w) for w in olds], args.reps)
        del olds
        del weights
        bf16_copies = max(2, -(-ROTATE_BYTES // (2 * n * k)))
        dense = [torch.randn(n, k, device=CUDA, dtype=torch.bfloat16) for _ in range(bf16_copies)]
        bf16_ms = time_ms([lambda w=w, x=x: x @ w.t() for w in dense], args.reps)
        del dense
        row = {
            "n": n,
            "k": k,
            "m": args.m,
            "symmetric": sym,
            "config": dataclasses.asdict(config),
            "rel_err": err,
            "new_ms": round(new_ms, 4),
            "old_ms": round(old_ms, 4),
            "bf16_ms": round(bf16_ms, 4),
            "new_gb_s": round(nbytes / new_ms / 1e6, 1),
            "old_gb_s": round(nbytes / old_ms / 1e6, 1),
            "bf16_gb_s": round(2 * n * k / bf16_ms / 1e6, 1),
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        if args.sweep:
            grid = sweep_grid(config, k, stages, args.narrow, regs, prefetch, block_ks, warps)
            results += sweep(n, k, args.m, nbytes, copies, args.reps, grid, sym)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "int4_gemv.json").write_text(json.dumps(results, indent=1))


def sweep_grid(
    default: GemvConfig,
    k: int,
    stages: tuple[int, ...],
    narrow: bool,
    regs: tuple[int | None, ...] = (None,),
    prefetch: tuple[int | None, ...] = (None,),
    block_ks: tuple[int, ...] = (512, 1024, 2048),
    warps: tuple[int, ...] = (4,),
) -> list[GemvConfig]:
    """Launch shapes to time: a wide grid, or (narrow) the default's neighbours (K steps of
    `block_ks`, `warps` a program), each at every pipeline depth in `stages`, register cap
    in `regs` and prefetch depth in `prefetch`."""
    if narrow:
        splits = {default.split_k, max(1, default.split_k // 2), 2 * default.split_k}
        # several prefetch depths: the default tile only, so the sweep stays a few minutes
        several = len(prefetch) > 1
        grid = itertools.product(
            (default.block_n,)
            if several
            else (max(8, default.block_n // 2), default.block_n, 2 * default.block_n),
            (default.block_k,) if several else block_ks,
            sorted(splits),
            warps,
            stages,
            regs,
            prefetch,
        )
    else:
        grid = itertools.product(
            (16, 32, 64),
            (256, 512, 1024, 2048),
            (1, 2, 4, 7, 8, 16),
            (4, 8),
            stages,
            regs,
            prefetch,
        )
    return [
        GemvConfig(block_n, block_k, split_k, warps, depth, nreg, lines)
        for block_n, block_k, split_k, warps, depth, nreg, lines in grid
        if k // block_k >= split_k  # no empty splits
    ]


def sweep(
    n: int,
    k: int,
    m: int,
    nbytes: int,
    copies: int,
    reps: int,
    grid: list[GemvConfig],
    symmetric: bool = False,
) -> list[dict]:
    """The new GEMV under each launch shape of `grid`; prints each and the best."""
    weights = [make_weight(n, k, seed, symmetric) for seed in range(copies)]
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    rows = []
    for config in grid:
        fns = [lambda w=w, c=config: int4_gemv(x, *w, None, GROUP, c) for w in weights]
        ms = time_ms(fns, reps // 2)
        row = {"n": n, "k": k, "sweep": dataclasses.asdict(config), "ms": round(ms, 4)}
        row["gb_s"] = round(nbytes / ms / 1e6, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"best": min(rows, key=lambda r: r["ms"])}), flush=True)
    return rows


if __name__ == "__main__":
    main()
