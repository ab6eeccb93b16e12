"""Triton RMSNorm and residual-add + RMSNorm, one row per program, fp32 statistics.

Both match reference.rms_norm bit for bit in structure: the normalised row is rounded to
x's dtype first and then multiplied by the weight (as HF's LlamaRMSNorm does), and the
output takes the promoted dtype of weight and x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_wait


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [N, hidden]
    sum_out_ptr,  # [N, hidden] x + residual (HAS_RESIDUAL only)
    x_ptr,  # [N / heads, heads, hidden], or NUM_PARTS fp32 partial sums [parts, N, hidden]
    residual_ptr,  # [N, hidden] (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    eps,
    hidden,
    heads,  # rows per outer index of x (1 for a 2-D x)
    stride_x_outer,
    stride_x_head,
    stride_r_row,
    stride_out_row,
    stride_sum_row,
    stride_part,
    BLOCK: tl.constexpr,  # pow2 >= hidden
    HAS_RESIDUAL: tl.constexpr,  # fused residual add
    PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
    NUM_PARTS: tl.constexpr = 0,  # x is this many partial sums (HAS_RESIDUAL only)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    # The weight before the wait (kernels/pdl.py; no kernel writes it): after the reduction
    # it would cost a round trip of its own.
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    pdl_wait(PDL)
    x_row = (row // heads) * stride_x_outer + (row % heads) * stride_x_head
    if NUM_PARTS > 0:
        # A split-K projection's output: its parts added in order and rounded to the
        # residual's dtype, as split_k.sum_splits writes it.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(NUM_PARTS):
            acc += tl.load(x_ptr + p * stride_part + x_row + cols, mask=mask, other=0.0)
        x = acc.to(residual_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r_row + cols, mask=mask, other=0.0)
        # The sum is rounded to x's dtype, as torch's x + residual is; the norm reads it back.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_out_ptr + row * stride_sum_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, hidden] view with a unit last stride (copies only if it must)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    parts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`parts` [P, N, hidden] fp32 stand for x (then x is the residual, for shapes)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    summed = (
        torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    )
    if x.numel() == 0:
        return out, summed
    if parts is not None:
        x2, heads, stride_outer, stride_head = parts, 1, parts.stride(1), 0
    elif residual is None and x.dim() == 3 and x.stride(-1) == 1:
        # [tokens, heads, head_dim], e.g. the query slice of a fused qkv projection's rows
        # (per-head norms): read in place, where flattening it to rows would copy it.
        x2, heads, stride_outer, stride_head = x, x.shape[1], x.stride(0), x.stride(1)
    else:
        x2 = _rows(x)
        heads, stride_outer, stride_head = 1, x2.stride(0), 0
    r2 = _rows(residual) if residual is not None else out
    out2 = out.view(-1, hidden)
    sum2 = summed.view(-1, hidden) if summed is not None else out2
    block = triton.next_power_of_2(hidden)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(out2.shape[0],)](
        out2,  # [N, hidden]
        sum2,  # [N, hidden]
        x2,  # [N / heads, heads, hidden]
        r2,  # [N, hidden]
        weight.contiguous(),  # [hidden]
        eps,  # epsilon
        hidden,  # hidden size
        heads,  # rows per outer index of x
        stride_outer,  # stride_x_outer
        stride_head,  # stride_x_head
        r2.stride(0) if residual is not None else 0,  # stride_r_row
        out2.stride(0),  # stride_out_row
        sum2.stride(0),  # stride_sum_row
        parts.stride(0) if parts is not None else 0,  # stride_part
        BLOCK=block,  # pow2 >= hidden
        HAS_RESIDUAL=residual is not None,  # fused add
        PDL=pdl,  # launched with PDL
        NUM_PARTS=parts.shape[0] if parts is not None else 0,  # partial sums for x
        num_warps=min(16, max(1, block // 256)),
        **pdl_launch(pdl),
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), reading x and residual once."""
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    out, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return out, summed


def add_parts_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm with x given as a split-K projection's fp32 partial sums [P, ..., hidden]
    (x = their sum in order, rounded to the residual's dtype): the split sum, the residual add
    and the norm in one kernel."""
    if parts.dtype != torch.float32 or parts.shape[1:] != residual.shape:
        raise ValueError(
            f"partial sums {tuple(parts.shape)} {parts.dtype} do not match residual "
            f"{tuple(residual.shape)} (fp32 [parts, *residual.shape] expected)"
        )
    hidden = residual.shape[-1]
    flat = parts.reshape(parts.shape[0], -1, hidden)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out, summed = _launch(residual, residual, weight, eps, flat)
    assert summed is not None
    return out, summed
