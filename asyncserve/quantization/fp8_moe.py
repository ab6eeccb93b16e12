"""FP8 (e4m3) experts of a sparse MoE layer (models/moe.py's SparseMoE).

The stacked w13 [E, 2I, H] and w2 [E, H, I] become e4m3 with fp32 scales (layout in
kernels/quant_reference.py, fused_moe_fp8):
- channel: one scale per expert row, w13_scale [E, 2I, 1] / w2_scale [E, H, 1]. Serves
  `--quantization fp8` on an unquantized checkpoint (quantized per expert and row once
  loaded), compressed-tensors "channel" and "tensor", and HF fp8 per-tensor checkpoints.
- block: one scale per [bn, bk] tile, w13's gate and up halves tiled apart (Qwen3-MoE
  "FP8" checkpoints: `weight_block_size`, `weight_scale_inv`; compressed-tensors "block").
Activations are quantized per token (per token and bk columns for block scales) at run
time. CUDA: the Triton fused MoE reads the fp8 experts; CPU: the dequantizing reference.
The router stays unquantized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncserve.kernels import quant_reference as reference
from asyncserve.kernels.quant_reference import FP8_DTYPE
from asyncserve.models.weights import Target
from asyncserve.quantization.base import set_weight_attrs
from asyncserve.quantization.fp8 import quantize_fp8_per_channel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8MoEMethod:
    """online: the checkpoint holds unquantized experts, quantized per channel once loaded.
    scale_name: the checkpoint's name for the scales; per_tensor: one scale per checkpoint
    tensor (broadcast over its rows)."""

    def __init__(
        self,
        block: tuple[int, int] | None = None,
        scale_name: str = "weight_scale",
        online: bool = False,
        per_tensor: bool = False,
    ) -> None:
        self.block = block
        self.scale_name = scale_name
        self.online = online
        self.per_tensor = per_tensor

    def create_weights(self, moe: Any, dtype: torch.dtype) -> None:
        """Replace moe's (meta) w13 / w2 with this scheme's parameters, on the current
        default device."""
        num_local, two_i, hidden = moe.w13.shape
        inter = two_i // 2
        if self.online:
            moe.w13 = nn.Parameter(torch.empty(num_local, two_i, hidden, dtype=dtype), False)
            moe.w2 = nn.Parameter(torch.empty(num_local, hidden, inter, dtype=dtype), False)
            return
        moe.w13 = nn.Parameter(torch.empty(num_local, two_i, hidden, dtype=FP8_DTYPE), False)
        moe.w2 = nn.Parameter(torch.empty(num_local, hidden, inter, dtype=FP8_DTYPE), False)
        if self.block is None:
            moe.w13_scale = set_weight_attrs(
                nn.Parameter(torch.empty(num_local, two_i, 1), False),
                broadcast=self.per_tensor,
                in_dim=-1,
            )
            moe.w2_scale = set_weight_attrs(
                nn.Parameter(torch.empty(num_local, hidden, 1), False),
                broadcast=self.per_tensor,
                in_dim=-1,
            )
            return
        bn, bk = self.block
        if inter != moe.moe.intermediate_size and (inter % bn or inter % bk):
            raise ValueError(
                f"tensor parallelism gives each rank {inter} of the experts' intermediate "
                f"features, not a multiple of the FP8 block {list(self.block)}"
            )
        # Block scales are routed in whole entries (scale_target): no quant attributes.
        rows = _cdiv(inter, bn)
        moe.w13_scale = nn.Parameter(torch.empty(num_local, 2 * rows, _cdiv(hidden, bk)), False)
        moe.w2_scale = nn.Parameter(
            torch.empty(num_local, _cdiv(hidden, bn), _cdiv(inter, bk)), False
        )

    def scale_target(self, moe: Any, prefix: str, proj: str, local: int) -> Target:
        """Where one expert's `{gate,up,down}_proj.<scale_name>` goes (expert index local)."""
        start, size = moe.intermediate_start, moe.intermediate
        sliced = size != moe.moe.intermediate_size
        if self.block is None:
            if proj == "down":  # one scale per output row: every rank reads all of it
                return Target(f"{prefix}.w2_scale", expert=local)
            rows = (0 if proj == "gate" else size, size)
            return Target(
                f"{prefix}.w13_scale",
                expert=local,
                rows=rows,
                source=(0, start, size) if sliced else None,
            )
        bn, bk = self.block
        if proj == "down":
            source = (1, start // bk, size // bk) if sliced else None
            return Target(f"{prefix}.w2_scale", expert=local, source=source)
        entries = _cdiv(size, bn)
        return Target(
            f"{prefix}.w13_scale",
            expert=local,
            rows=(0 if proj == "gate" else entries, entries),
            source=(0, start // bn, entries) if sliced else None,
        )

    @torch.no_grad()
    def process_weights_after_loading(self, moe: Any) -> None:
        if not self.online:
            return
        w13 = moe.w13.data
        q13, s13 = quantize_fp8_per_channel(w13.reshape(-1, w13.shape[2]))
        w2 = moe.w2.data
        amax = w2.float().abs().amax(dim=2, keepdim=True)
        tp = moe.tp_slice
        if tp.size > 1:
            # Each rank holds part of every w2 row: scale by the whole row, as one device
            # would, so that every tensor-parallel size serves the same weights.
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=tp.group)
        q2, s2 = quantize_fp8_per_channel(w2.reshape(-1, w2.shape[2]), amax.reshape(-1, 1))
        moe.w13 = nn.Parameter(q13.view(w13.shape), requires_grad=False)
        moe.w13_scale = nn.Parameter(s13.view(*w13.shape[:2], 1), requires_grad=False)
        moe.w2 = nn.Parameter(q2.view(w2.shape), requires_grad=False)
        moe.w2_scale = nn.Parameter(s2.view(*w2.shape[:2], 1), requires_grad=False)

    def apply(
        self, moe: Any, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        if hidden.is_cuda:
            from asyncserve.kernels.moe import fused_moe

            return fused_moe(
                hidden,
                moe.w13,
                moe.w2,
                weights,
                ids,
                moe.expert_map,
                w13_scale=moe.w13_scale,
                w2_scale=moe.w2_scale,
                block=self.block,
            )
        # CPU: the fp32 experts are made once (the CPU path emulates the numerics).
        cached = getattr(moe, "_dequantized", None)
        if cached is None:
            cached = moe._dequantized = (
                reference.dequant_fp8_experts(moe.w13, moe.w13_scale, self.block, 2),
                reference.dequant_fp8_experts(moe.w2, moe.w2_scale, self.block, 1),
            )
        return reference.fused_moe_fp8(
            hidden,
            moe.w13,
            moe.w13_scale,
            moe.w2,
            moe.w2_scale,
            self.block,
            weights,
            ids,
            moe.expert_map,
            dequantized=cached,
        )
