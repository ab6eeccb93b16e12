"""GGUF kept-quantized matmuls (Q8_0, Q4_K, Q4_1) vs bf16 on Llama-3-8B's linear shapes.

For each shape and token count: device time (CUDA graph replay, median) of
kernels/gguf_gemm.gguf_matmul and of the bf16 torch.matmul, and the weight bandwidth the
GGUF kernel reaches (bytes of its repacked weight / time). Results as JSON lines on stdout
and in $OUT/gguf_gemm.json. Usage: OUT=/tmp/out python benchmarks/bench_gguf_gemm.py
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from asyncserve.kernels.gguf_gemm import gguf_matmul
from asyncserve.kernels.quant_reference import pack_int4

CUDA = torch.device("cuda")
# Llama-3-8B: fused qkv, o, fused gate_up, down as (N, K).
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TOKENS = [1, 4, 16, 128, 1024]


def _ms(fn: object) -> float:
    return min(float(do_bench_cudagraph(fn, rep=100, return_mode="median")) for _ in range(2))


def layout(qtype: str, n: int, k: int) -> tuple:
    """A random repacked weight (see quant_reference.dequant_gguf) on the GPU."""
    g = torch.Generator(device=CUDA).manual_seed(n + k)
    scale = (torch.rand(n, k // 32, device=CUDA, generator=g) * 0.01).half()
    if qtype == "Q8_0":
        q = torch.randint(-127, 128, (n, k), device=CUDA, generator=g, dtype=torch.int8)
        return q, scale, None, None, None, 32
    nibbles = torch.randint(0, 16, (n, k), device=CUDA, generator=g)
    if qtype == "Q4_1":
        return pack_int4(nibbles), scale, -scale, None, None, 32
    d = scale[:, ::8].contiguous()  # Q4_K: super-blocks of 256, 6-bit sub-block factors
    sub = torch.randint(0, 64, (n, k // 32), device=CUDA, generator=g, dtype=torch.uint8)
    return pack_int4(nibbles), d, d, sub, sub.flip(1).contiguous(), 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    args = parser.parse_args()
    results = []
    for n, k in SHAPES:
        w_bf16 = torch.randn(n, k, device=CUDA, dtype=torch.bfloat16) * 0.02
        for qtype in ("Q8_0", "Q4_K", "Q4_1"):
            lay = layout(qtype, n, k)
            nbytes = sum(t.numel() * t.element_size() for t in lay[:5] if t is not None)
            for m in args.tokens:
                x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
                ms = _ms(lambda x=x, lay=lay: gguf_matmul(x, *lay))
                bf16_ms = _ms(lambda x=x, w=w_bf16: x @ w.t())
                row = {
                    "n": n,
                    "k": k,
                    "m": m,
                    "type": qtype,
                    "gguf_ms": round(ms, 4),
                    "bf16_ms": round(bf16_ms, 4),
                    "weight_gb_s": round(nbytes / ms / 1e6, 1),
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gguf_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
