"""Compile the W4A16 decode kernels for Hopper (sm_90) on a machine without a GPU, and print
each one's registers a thread and shared memory: a compile error or a register jump shows
here before a GPU call is spent on it.

Triton's active driver is swapped for one that names an sm_90 target and stops at the
launch (as tests/kernels/test_parallel_compiles.py does), so each wrapper below runs its
host code and compiles its kernels with the local Triton and ptxas, then stops. The local
Triton may be newer than the GPU machine's: register counts are indicative.
Usage: python benchmarks/sm90_compile_check.py   (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Hopper:
    """What Triton asks of the device before a launch; the launch itself stops."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def launcher_cls(self, src: object, metadata: object) -> None:
        raise _Compiled


class _Compiled(Exception):
    pass


def _cases() -> dict[str, Callable[[], object]]:
    from asyncserve.kernels import attention, rope_store
    from asyncserve.kernels import quant_reference as reference
    from asyncserve.kernels.argmax import argmax_rows
    from asyncserve.kernels.int4_gemm import GroupGemmConfig, int4_group_gemm, int4_matmul
    from asyncserve.kernels.int4_gemv import GemvConfig, int4_gemv
    from asyncserve.kernels.norm import add_parts_rms_norm
    from asyncserve.kernels.rope_store import rope_store_kv
    from benchmarks.int4_gemv_tma import tma_gemv

    # The decode path's kernels as the GPU launches them: with PDL (kernels/pdl.py), so the
    # work placed before their waits compiles too.
    attention.pdl_enabled = rope_store.pdl_enabled = lambda device: True

    n, k, heads, kv_heads, dim = 256, 4096, 32, 8, 128
    w = (
        reference.pack_int4(torch.randint(0, 16, (n, k))),
        torch.rand(n, k // 128).bfloat16(),
        torch.randint(0, 16, (n, k // 128)).bfloat16(),
    )
    x = torch.randn(1, k).bfloat16()
    gidx = (torch.arange(k) // 128).to(torch.int32)
    qkv = torch.randn(2, 1, (heads + 2 * kv_heads) * dim)
    q, kk, v = (
        t.unflatten(-1, (-1, dim)) for t in qkv.split([heads * dim, *[kv_heads * dim] * 2], -1)
    )
    cache = torch.zeros(4, 16, kv_heads, dim).bfloat16()
    slot = torch.zeros(1, dtype=torch.long)
    return {
        "int4_gemv": lambda: int4_gemv(x, *w, None, 128, GemvConfig(16, 1024, 2)),
        "int4_gemv silu": lambda: int4_gemv(x, *w, None, 128, activation="silu"),
        "int4_gemv symmetric": lambda: int4_gemv(x, w[0], w[1], None, None, 128),
        "int4_gemv silu symmetric": lambda: int4_gemv(
            x, w[0], w[1], None, None, 128, activation="silu"
        ),
        "int4_gemv per-column symmetric": lambda: int4_gemv(x, w[0], w[1], None, gidx, 128),
        "int4_group_gemm symmetric": lambda: int4_group_gemm(
            torch.randn(16, k).bfloat16(), w[0], w[1], None, 128, torch.empty(16, n).bfloat16()
        ),
        "int4_matmul per-column symmetric": lambda: int4_matmul(
            torch.randn(32, k).bfloat16(), w[0], w[1], None, gidx, 128
        ),
        "int4_group_gemm split 4": lambda: int4_group_gemm(
            torch.randn(16, k).bfloat16(),
            *w,
            128,
            torch.empty(16, n).bfloat16(),
            GroupGemmConfig(16, 64, 128, 4, 3, 4),
        ),  # fmt: skip
        "add_parts_rms_norm": lambda: add_parts_rms_norm(
            torch.randn(3, 1, k), torch.randn(1, k).bfloat16(), torch.randn(k).bfloat16(), 1e-6
        ),
        "rope_store_kv parts": lambda: rope_store_kv(
            slot,
            q,
            kk,
            v,
            torch.randn(2048, dim),
            None,
            None,
            1e-6,
            cache,
            cache.clone(),
            slot,
            dtype=torch.bfloat16,
        ),  # fmt: skip
        "unified_attention decode, 8 splits": lambda: attention.paged_attention(
            q[0].bfloat16(),
            cache,
            cache.clone(),
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([40], dtype=torch.int32),
            torch.zeros(1, 4, dtype=torch.int32),
            dim**-0.5,
            attention.default_config(heads // kv_heads, 1),
            8,
        ),
        "argmax_rows": lambda: argmax_rows(torch.randn(1, 128256)),
        "tma_gemv 1024 x 2 stages": lambda: tma_gemv(x, *w, GemvConfig(16, 1024, 2, 4, 2)),
        "tma_gemv 256 x 4 stages": lambda: tma_gemv(x, *w, GemvConfig(16, 256, 2, 4, 4)),
    }


def _usage(cubin: Path) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    return " ".join(part for part in out.split() if part.startswith(("REG:", "SHARED:")))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    cache = Path(tempfile.mkdtemp(prefix="sm90-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    driver.set_active(_Hopper())
    failed = False
    for name, case in _cases().items():
        seen = set(cache.glob("*/*.cubin"))
        try:
            case()
            status = "ran (no kernel launched?)"
        except _Compiled:
            status = "compiled"
        except Exception as exc:  # noqa: BLE001  (a compile error: print it, go on)
            status, failed = f"FAILED: {type(exc).__name__}: {str(exc)[:1500]}", True
        new = sorted(set(cache.glob("*/*.cubin")) - seen)
        print(f"{name}: {status}; " + "; ".join(f"{c.stem} {_usage(c)}" for c in new))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
