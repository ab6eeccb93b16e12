"""Sparse MoE layer: a router picks top-k experts per token; the fused MoE op runs them.

Expert weights are stacked: w13 [local experts, 2 * intermediate, hidden] (gate rows, then
up rows) and w2 [local experts, hidden, intermediate]. Under tensor parallelism each rank
holds a slice of every expert's intermediate dim (column-parallel gate/up, row-parallel
down); with expert parallelism an ExpertPlacement puts whole experts on ranks instead. Either
way each rank computes its share of every token and `reduce` (an all-reduce; identity on one
rank) sums the shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from asyncserve.kernels.moe_config import config_change_sizes, device_name, dtype_name
from asyncserve.kernels.ops import KernelOps
from asyncserve.models.arch_config import MoEArch
from asyncserve.models.layers import Linear
from asyncserve.models.parallel import SINGLE, TensorParallel
from asyncserve.models.weights import Target
from asyncserve.quantization.base import in_quantized_build


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts this rank holds: e % world_size == rank ("strided"), or the rank-th of
    world_size contiguous ranges ("contiguous")."""

    rank: int = 0
    world_size: int = 1
    layout: str = "strided"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.layout not in ("strided", "contiguous"):
            raise ValueError(f"expert layout {self.layout!r} is not strided or contiguous")

    def local_experts(self, num_experts: int) -> list[int]:
        if num_experts < self.world_size:
            raise ValueError(f"{num_experts} experts cannot spread over {self.world_size} ranks")
        if self.layout == "strided":
            return list(range(self.rank, num_experts, self.world_size))
        per_rank, extra = divmod(num_experts, self.world_size)
        start = self.rank * per_rank + min(self.rank, extra)
        return list(range(start, start + per_rank + (self.rank < extra)))


class SparseMoE(nn.Module):
    """Router (`gate`) + stacked experts; forward [T, hidden] -> [T, hidden]."""

    expert_map: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        moe: MoEArch,
        ops: KernelOps,
        placement: ExpertPlacement | None = None,
        router_bias: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.moe = moe
        if placement is None and tp.expert_parallel and tp.size > 1:
            placement = ExpertPlacement(tp.rank, tp.size, "contiguous")
        placement = placement or ExpertPlacement()
        self.local_experts = placement.local_experts(moe.num_experts)
        self.local_index = {e: i for i, e in enumerate(self.local_experts)}
        num_local = len(self.local_experts)
        # This rank's slice of every expert's intermediate dim (all of it with whole experts).
        sliced = tp if not tp.expert_parallel else SINGLE
        self.tp_slice = sliced
        self.intermediate_start, self.intermediate = sliced.split(moe.intermediate_size)
        self.gate = Linear(hidden_size, moe.num_experts, bias=router_bias)
        # Quantized builds: shapes only; the scheme's method makes the parameters
        # (quantization/model.py).
        device = torch.device("meta") if in_quantized_build() else None
        self.w13 = nn.Parameter(
            torch.empty(num_local, 2 * self.intermediate, hidden_size, device=device),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_local, hidden_size, self.intermediate, device=device),
            requires_grad=False,
        )
        self.quant_method: Any = None
        if num_local == moe.num_experts:
            self.expert_map = None
        else:
            expert_map = torch.full((moe.num_experts,), -1, dtype=torch.int32)
            expert_map[self.local_experts] = torch.arange(num_local, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map.to(torch.empty(0).device))
        # Sums the ranks' partial outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = (
            tp.all_reduce if tp.size > 1 else _identity
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden)
        weights, ids = self.ops.moe_route(
            logits, self.moe.top_k, self.moe.renormalize, self.moe.scoring
        )
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, weights, ids)
        else:
            out = self.ops.fused_moe(hidden, self.w13, self.w2, weights, ids, self.expert_map)
        return self.reduce(out)


def kernel_warm_up_sizes(
    moe: MoEArch | None,
    tensor_parallel_size: int,
    expert_parallel: bool,
    max_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[int]:
    """Token counts (up to max_tokens) at which the fused MoE layers pick different kernel
    tiles: a forward pass at each compiles them all before serving. Computed from the model's
    config alone, so that every rank and pipeline stage runs the same passes (their
    collectives match); [] without MoE layers, off CUDA, or when expert parallelism splits
    the experts unevenly (the ranks' shapes, and so their tiles, would differ)."""
    if moe is None or device.type != "cuda":
        return []
    if expert_parallel:
        if moe.num_experts % tensor_parallel_size:
            return []
        experts, intermediate = moe.num_experts // tensor_parallel_size, moe.intermediate_size
    else:  # every rank holds an equal slice of every expert (TensorParallel.split)
        experts, intermediate = moe.num_experts, moe.intermediate_size // tensor_parallel_size
    return config_change_sizes(
        max_tokens, experts, intermediate, dtype_name(dtype), device_name(device)
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def expert_target(
    moe: object, prefix: str, proj: str, expert: int | None, suffix: str = "weight"
) -> Target | None:
    """Where one checkpoint tensor of an MoE layer goes.

    prefix is the layer's parameter prefix ("model.layers.3.mlp"); proj is "gate" or "up"
    (one expert's half of w13), "gate_up" (both halves) or "down"; expert is the global
    expert id, or None for a tensor that stacks every expert. Another rank's expert -> None.
    With the intermediate dim split over ranks, the target names this rank's slice.
    suffix: "weight", or a quantization scale's name (the layer's quant_method places it).
    """
    if not isinstance(moe, SparseMoE):
        raise ValueError(f"checkpoint has expert weights for {prefix}, a dense MLP in the model")
    if suffix != "weight":
        method = moe.quant_method
        if method is None or getattr(method, "scale_name", None) != suffix:
            raise ValueError(
                f"checkpoint has expert tensors {prefix}...{suffix} that the model's "
                "quantization scheme does not read"
            )
        if expert is None or proj == "gate_up":
            raise ValueError(f"{prefix}: quantized experts must be stored one per projection")
        local_id = moe.local_index.get(expert)
        return None if local_id is None else method.scale_target(moe, prefix, proj, local_id)
    param = f"{prefix}.w2" if proj == "down" else f"{prefix}.w13"
    start, size = moe.intermediate_start, moe.intermediate
    sliced = size != moe.moe.intermediate_size
    if expert is None:
        if sliced:
            raise ValueError(f"{prefix}: stacked expert weights must be split per expert")
        keep = None if moe.expert_map is None else moe.local_experts
        return Target(param, source_experts=keep)
    local = moe.local_index.get(expert)
    if local is None:
        return None
    if proj in ("gate", "up"):
        rows = (0 if proj == "gate" else size, size)
        return Target(param, expert=local, rows=rows, source=(0, start, size) if sliced else None)
    if proj == "gate_up":
        raise ValueError(f"{prefix}: one expert's fused gate_up must be split into gate and up")
    return Target(param, expert=local, source=(1, start, size) if sliced else None)
