"""KernelOps: the set of kernel functions a model runs with (one implementation per device
kind: kernels/reference.py on CPU, kernels/triton_ops.py on CUDA; ops.select_ops picks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelOps:
    """Functions with the signatures of kernels/reference.py."""

    name: str
    store_kv: Callable[..., None]
    unified_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_parts_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_store_kv: Callable[..., torch.Tensor]
    silu_and_mul: Callable[..., torch.Tensor]
    gelu_tanh_and_mul: Callable[..., torch.Tensor]
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
