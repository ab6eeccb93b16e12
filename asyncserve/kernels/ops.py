"""The kernel set a model runs with: the torch references on CPU, Triton kernels on CUDA."""

from __future__ import annotations

import torch

from asyncserve.kernels import reference
from asyncserve.kernels.interface import KernelOps

__all__ = ["REFERENCE_OPS", "KernelOps", "select_ops"]


REFERENCE_OPS = KernelOps(
    name="reference",
    store_kv=reference.store_kv,
    unified_attention=reference.unified_attention,
    rms_norm=reference.rms_norm,
    fused_add_rms_norm=reference.fused_add_rms_norm,
    add_parts_rms_norm=reference.add_parts_rms_norm,
    rotary_embedding=reference.rotary_embedding,
    rope_store_kv=reference.rope_store_kv,
    silu_and_mul=reference.silu_and_mul,
    gelu_tanh_and_mul=reference.gelu_tanh_and_mul,
    moe_route=reference.moe_route,
    fused_moe=reference.fused_moe,
)


def select_ops(device: torch.device) -> KernelOps:
    if device.type == "cuda":
        from asyncserve.kernels.triton_ops import TRITON_OPS

        return TRITON_OPS
    return REFERENCE_OPS
