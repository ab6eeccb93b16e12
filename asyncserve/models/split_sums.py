"""A projection's output left as its K splits' fp32 partial sums.

A decode step's split-K GEMV (kernels/int4_gemv.py) ends in a small kernel that adds its
splits. Where the output goes straight into a residual add + RMSNorm (o_proj and a gated
MLP's down_proj, then the next norm) or into the rotary + KV-store kernel (qkv_proj), that
kernel adds the splits itself (norm.add_parts_rms_norm, rope_store.rope_store_kv), in the
same order and with the same rounding: one kernel fewer per projection. Any other consumer
takes `dense()`. layers.linear_parts asks a projection for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncserve.kernels import reference


@dataclass(frozen=True)
class SplitSums:
    """parts [splits, ..., N] fp32 whose in-order sum, rounded to `dtype`, is the output."""

    parts: torch.Tensor
    dtype: torch.dtype

    def dense(self) -> torch.Tensor:
        return reference.sum_parts(self.parts).to(self.dtype)


def dense(hidden: torch.Tensor | SplitSums) -> torch.Tensor:
    return hidden.dense() if isinstance(hidden, SplitSums) else hidden
