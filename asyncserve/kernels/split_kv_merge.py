"""The second pass of split-KV attention (kernels/attention_kernel.py): each query row's NUM_SPLITS
unnormalised partial results (accumulator, running max in the log2 domain, running sum; fp32)
merged into its output row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_max_ptr,  # [T, H, NUM_SPLITS] fp32, log2 domain
    part_sum_ptr,  # [T, H, NUM_SPLITS] fp32
    num_heads,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (tok * num_heads + head) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + base + offs_s)
    l_s = tl.load(part_sum_ptr + base + offs_s)
    # Some split holds each query's own key, which it always sees, so the max is finite;
    # splits with no visible key carry -inf and get weight 0.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def merge_splits(
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    pdl: bool,
) -> None:
    """out [T, H, D] from the partials part_acc [T, H, S, Dp], part_max and part_sum
    [T, H, S]; `pdl`: launched with programmatic dependent launch (kernels/pdl.py)."""
    num_tokens, num_heads, head_dim = out.shape
    _merge_splits_kernel[(num_tokens, num_heads)](
        out,  # [T, H, D]
        part_acc,  # [T, H, S, Dp] fp32
        part_max,  # [T, H, S] fp32
        part_sum,  # [T, H, S] fp32
        num_heads,  # H
        out.stride(0),  # stride_o_tok
        out.stride(1),  # stride_o_head
        NUM_SPLITS=part_max.shape[2],  # S
        HEAD_DIM=head_dim,  # D
        HEAD_DIM_PAD=part_acc.shape[3],  # pow2 >= D
        PDL=pdl,
        num_warps=4,
        **pdl_launch(pdl),
    )
