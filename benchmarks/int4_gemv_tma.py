"""The int4 GEMV with its packed words loaded through a TMA tensor descriptor, pipelined
NUM_STAGES deep through shared memory, against kernels/int4_gemv.py (one token, group 128,
Llama-3-8B's shapes).

The GEMV's profile (BENCHMARKS.md: Nsight Compute on gate_up) says too few bytes are in
flight per SM: a program's words travel through registers, so a loop step's loads must land
before its arithmetic, and 64 registers a thread hold occupancy at 50%. TMA copies a step's
[BLOCK_N, BLOCK_K / 8] words into shared memory without registers, and the loop's pipeline
issues the next steps' copies while this one computes. The arithmetic is int4_gemv's
(scale * (sum q * x - zero * sum x) per row and group), so only the loads differ.

Usage: python benchmarks/int4_gemv_tma.py            (GPU: a sweep of tiles, stages and
           splits beside int4_gemv; JSON rows)
       python benchmarks/int4_gemv_tma.py --check    (correctness on small shapes; on a
           CPU under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncserve.kernels.int4_gemv import (  # noqa: E402
    GemvConfig,
    int4_gemv,
    whole_group_step,
)
from asyncserve.kernels.split_k import (  # noqa: E402
    gemv_program,
    pick_split_k,
    split_layout,
    sum_splits,
)

GROUP = 128


@triton.jit
def _tma_gemv_kernel(
    x_ptr, qw_desc, s_ptr, z_ptr, out_ptr, m, n, k, k_split, stride_xm, stride_sn, stride_om,
    stride_osplit, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """out[split, row, n-block] as _int4_gemv_kernel's whole-group path (even K: every step
    whole and inside the split; BLOCK_K a multiple of GROUP or a divisor of it)."""
    row, offs_n, mask_n, rows, pid_k, k_start, k_end = gemv_program(m, n, k, k_split, BLOCK_N)
    n0 = (tl.program_id(0) // m) * BLOCK_N
    SUB_K: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
    NSUB: tl.constexpr = BLOCK_K // SUB_K
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros([BLOCK_N, NSUB], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        # Rows past N come back as zeros (the descriptor's bounds); their store is masked.
        wu = qw_desc.load([n0, k0 // 8]).to(tl.uint32, bitcast=True)
        acc += whole_group_step(
            wu, x_row, k0, k_end, rows, s_ptr, z_ptr, stride_sn, GROUP, True, BLOCK_N, BLOCK_K,
            SUB_K,
        )  # fmt: skip
    out = out_ptr + pid_k * stride_osplit + row * stride_om + offs_n
    tl.store(out, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=mask_n)


def tma_gemv(  # type: ignore[no-untyped-def]
    x, qweight, scales, zeros, config: GemvConfig, desc: TensorDescriptor | None = None
):
    """x [M, K] @ dequant(W)^T like int4_gemv(x, qweight, scales, zeros, None, GROUP);
    `desc` (made once per weight, as a layer would) or one made here."""
    m, k = x.shape
    n = qweight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_split, split_k, even_k = split_layout(k, config.block_k, config.split_k)
    assert even_k and (config.block_k % GROUP == 0 or GROUP % config.block_k == 0)
    if desc is None:
        desc = TensorDescriptor.from_tensor(qweight, [config.block_n, config.block_k // 8])
    partial = out if split_k == 1 else torch.empty((split_k, m, n), device=x.device)
    _tma_gemv_kernel[(m * triton.cdiv(n, config.block_n), split_k)](
        x, desc, scales, zeros, partial, m, n, k, k_split, x.stride(0), scales.stride(0), n,
        m * n, GROUP=GROUP, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NUM_STAGES=config.num_stages, num_warps=config.num_warps,
    )  # fmt: skip
    if split_k > 1:
        sum_splits(partial, out)
    return out


def check(device: torch.device) -> bool:
    """tma_gemv against int4_gemv and the fp32 reference on small shapes (ragged N, one
    and several splits, steps of a whole group and of half a group)."""
    from asyncserve.kernels import quant_reference as reference

    ok = True
    g = torch.Generator().manual_seed(0)
    for n, k, block_n, block_k, split in [(40, 512, 16, 128, 1), (32, 1024, 16, 256, 2),
                                          (24, 512, 8, 64, 2)]:  # fmt: skip
        values = torch.randint(0, 16, (n, k), generator=g)
        values[0, :] = 15
        qweight = reference.pack_int4(values).to(device)
        scales = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3).bfloat16().to(device)
        zeros = torch.randint(0, 16, (n, k // GROUP), generator=g).bfloat16().to(device)
        for m, dtype in itertools.product((1, 2), (torch.bfloat16, torch.float32)):
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            ref = reference.int4_matmul(x.float(), qweight, scales, zeros, None, GROUP).float()
            config = GemvConfig(block_n, block_k, split, 4, 2)
            out = tma_gemv(x, qweight, scales, zeros, config).float()
            err = float((out - ref).abs().max()) / float(ref.abs().max())
            base = int4_gemv(x, qweight, scales, zeros, None, GROUP).float()
            base_err = float((base - ref).abs().max()) / float(ref.abs().max())
            row = {"n": n, "k": k, "m": m, "dtype": str(dtype)[6:], "err": float(f"{err:.3g}")}
            row["int4_gemv_err"] = float(f"{base_err:.3g}")
            ok &= err <= (2e-6 if dtype == torch.float32 else 1e-2)
            print(json.dumps(row), flush=True)
    print(json.dumps({"check": "pass" if ok else "FAIL"}), flush=True)
    return ok


def main() -> None:
    from benchmarks.graph_timing import time_ms
    from benchmarks.int4_gemv_bench import experiment_cases

    for case in experiment_cases(check):
        n, k, weights, x = case.n, case.k, case.weights, case.x
        ms = time_ms(
            [lambda w=w, x=x, c=case.base: int4_gemv(x, *w, None, GROUP, c) for w in weights], 100
        )
        print(json.dumps({"n": n, "k": k, "int4_gemv_ms": round(ms, 4)}), flush=True)
        rows = []
        for block_n, block_k, stages in itertools.product((16, 32), (256, 512, 1024), (2, 3, 4)):
            steps = triton.cdiv(k, block_k)
            for split in sorted({pick_split_k(triton.cdiv(n, block_n), steps, case.sms), 1}):
                config = GemvConfig(block_n, block_k, split, 4, stages)
                try:
                    descs = [
                        TensorDescriptor.from_tensor(w[0], [block_n, block_k // 8]) for w in weights
                    ]
                    out = tma_gemv(x, *weights[0], config, descs[0]).float()
                    err = float((out - case.ref).abs().max() / case.ref.abs().max())
                    fns = [
                        lambda w=w, d=d, c=config, x=x: tma_gemv(x, *w, c, d)
                        for w, d in zip(weights, descs, strict=True)
                    ]
                    ms = time_ms(fns, 50)
                except Exception as exc:  # noqa: BLE001  (a tile past TMA's or smem's limits)
                    print(json.dumps({"config": [block_n, block_k, split, stages],
                                      "error": str(exc)[:200]}), flush=True)  # fmt: skip
                    continue
                row = {"n": n, "k": k, "config": [block_n, block_k, split, stages]}
                gb_s = round(case.nbytes / ms / 1e6)
                row.update(ms=round(ms, 4), gb_s=gb_s, rel_err=round(err, 5))
                print(json.dumps(row), flush=True)
                rows.append(row)
        if rows:
            print(json.dumps({"best": min(rows, key=lambda r: r["ms"])}), flush=True)


if __name__ == "__main__":
    main()
