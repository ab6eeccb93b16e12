"""The most a decode step could gain by fusing a kernel away: side_by_side.py with some of the
decode path's small kernels left out (their outputs allocated, never computed).

The values are wrong; the timing is what the step costs without those launches, which bounds
what a fusion that removes them can gain (with programmatic dependent launch, a kernel costs
a step more than its own work: it waits for the whole kernel before it, and the next one for
it). Leaves out any of:

    rope   the rotary + KV-store kernel (a fusion into attention would replace it)
    merge  split-KV attention's merge kernel
    norm   the residual add + RMSNorm kernels
    attn   decode attention (its kernel and split-KV merge; the bound on making it faster)

    python benchmarks/w2_ablate.py rope,merge benchmarks/side_by_side.py --engine asyncserve \
        --workloads w2 --model benchmarks/configs/llama3-8b-w4a16
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
from typing import Any

import torch

import asyncserve.kernels.attention as attention
import asyncserve.kernels.triton_ops as triton_ops

KINDS = {"rope", "merge", "norm", "attn"}


def no_rope_store(
    positions: torch.Tensor, query: torch.Tensor, *rest: Any, **kw: Any
) -> torch.Tensor:
    """The query as attention reads it, without the kernel ([T, H, D] from split sums)."""
    if query.dim() == 4:
        return torch.empty(query.shape[1:], dtype=kw["dtype"], device=query.device)
    return query


def no_add_norm(
    x: torch.Tensor, residual: torch.Tensor, *rest: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(residual), residual


def no_attention(query: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
    return torch.empty_like(query)


def no_norm(x: torch.Tensor, *rest: Any) -> torch.Tensor:
    return torch.empty_like(x)


def main() -> None:
    kinds = set(sys.argv.pop(1).split(","))
    if not kinds <= KINDS:
        raise SystemExit(f"unknown kinds {sorted(kinds - KINDS)}; choose from {sorted(KINDS)}")
    ops = triton_ops.TRITON_OPS
    if "rope" in kinds:
        ops = dataclasses.replace(ops, rope_store_kv=no_rope_store)
    if "norm" in kinds:
        ops = dataclasses.replace(
            ops, rms_norm=no_norm, fused_add_rms_norm=no_add_norm, add_parts_rms_norm=no_add_norm
        )
    if "attn" in kinds:
        ops = dataclasses.replace(ops, unified_attention=no_attention)
    if "merge" in kinds:
        attention.merge_splits = lambda *args: None  # type: ignore[assignment]
    triton_ops.TRITON_OPS = ops  # ops.select_ops reads it when the model is built
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
