"""Triton activation-and-multiply of the gate and up halves of a fused MLP projection:
SiLU (Llama and most families) or GELU with the tanh approximation (Gemma)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_enabled, pdl_launch, pdl_wait

# sqrt(2 / pi), as torch's tanh-approximated GELU uses it (constexpr: kernels read no other
# globals).
_GELU_BETA = tl.constexpr(0.7978845608028654)


@triton.jit
def gated_activation(gate, GELU_TANH: tl.constexpr):
    """act(gate) for fp32 `gate`: SiLU, or GELU with the tanh approximation."""
    if GELU_TANH:
        inner = _GELU_BETA * (gate + 0.044715 * gate * gate * gate)
        # tanh from exp(-2|inner|) <= 1: no overflow for large gates.
        e = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
        return 0.5 * gate * (1.0 + tanh)
    return gate / (1.0 + tl.exp(-gate))


@triton.jit
def _act_and_mul_kernel(
    out_ptr,  # [N, d]
    x_ptr,  # [N, 2 * d]
    d,
    stride_x_row,
    stride_out_row,
    GELU_TANH: tl.constexpr,  # GELU (tanh approximation) instead of SiLU
    BLOCK: tl.constexpr,  # columns per program
    PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + cols, mask=mask, other=0.0)
    act = gated_activation(gate, GELU_TANH)
    # Rounded to x's dtype between the two ops, as torch's act(gate) * up is.
    out = act.to(x_ptr.dtype.element_ty).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"last dimension {x.shape[-1]} is not even")
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    x2 = x.reshape(-1, 2 * d)
    out2 = out.view(-1, d)
    block = min(1024, triton.next_power_of_2(d))
    grid = (
        x2.shape[0],  # one row per program on axis 0
        triton.cdiv(d, block),  # column blocks on axis 1
    )
    pdl = pdl_enabled(x.device)
    _act_and_mul_kernel[grid](
        out2,  # [N, d]
        x2,  # [N, 2 * d]
        d,  # output columns
        x2.stride(0),  # stride_x_row
        out2.stride(0),  # stride_out_row
        GELU_TANH=gelu_tanh,  # which activation
        BLOCK=block,  # columns per program
        PDL=pdl,  # launched with PDL
        num_warps=4 if block >= 512 else 1,
        **pdl_launch(pdl),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2."""
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :d], approximate="tanh") * x[..., d:] with d = x.shape[-1] // 2."""
    return _act_and_mul(x, gelu_tanh=True)
