"""The Triton kernel set, selected by ops.select_ops on CUDA devices."""

from __future__ import annotations

from asyncserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from asyncserve.kernels.attention import unified_attention
from asyncserve.kernels.interface import KernelOps
from asyncserve.kernels.kv_store import store_kv
from asyncserve.kernels.moe import fused_moe, moe_route
from asyncserve.kernels.norm import add_parts_rms_norm, fused_add_rms_norm, rms_norm
from asyncserve.kernels.rope import rotary_embedding
from asyncserve.kernels.rope_store import rope_store_kv

TRITON_OPS = KernelOps(
    name="triton",
    store_kv=store_kv,
    unified_attention=unified_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    add_parts_rms_norm=add_parts_rms_norm,
    rotary_embedding=rotary_embedding,
    rope_store_kv=rope_store_kv,
    silu_and_mul=silu_and_mul,
    gelu_tanh_and_mul=gelu_tanh_and_mul,
    moe_route=moe_route,
    fused_moe=fused_moe,
)
