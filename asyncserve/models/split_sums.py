"""A projection's output left as its K splits' fp32 partial sums.

A decode step's split-K GEMV (kernels/int4_gemv.py) ends in a small kernel that adds its
splits. Where the output goes straight into a residual add + RMSNorm (o_proj and a gated
MLP's down_proj, then the next norm), that norm adds the splits itself
(norm.add_parts_rms_norm), in the same order and with the same rounding: one kernel fewer
per projection. Any other consumer takes `dense()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SplitSums:
    """parts [splits, ..., N] fp32 whose in-order sum, rounded to `dtype`, is the output."""

    parts: torch.Tensor
    dtype: torch.dtype

    def dense(self) -> torch.Tensor:
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


def dense(hidden: torch.Tensor | SplitSums) -> torch.Tensor:
    return hidden.dense() if isinstance(hidden, SplitSums) else hidden


def linear_parts(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | SplitSums:
    """layer(x), or its split-K partial sums where its quantization scheme leaves them
    (apply_parts); plain Linear layers only (LoRA and tensor-parallel wrappers add to or
    reduce the output)."""
    from asyncserve.models.layers import Linear

    if type(layer) is Linear and layer.quant_method is not None and layer.bias is None:
        parts = layer.quant_method.apply_parts(layer, x)
        if parts is not None:
            return SplitSums(parts, x.dtype)
    out: torch.Tensor = layer(x)
    return out
