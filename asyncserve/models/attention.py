"""Paged attention layer: store this step's K/V into the cache, then attend over it.

The same metadata serves every layer of a step; the runner builds it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from asyncserve.kernels.ops import KernelOps


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and which context each sequence sees.

    slot_mapping   [T] int64: block_id * block_size + offset per token; -1 = padding, not stored
    cu_seqlens_q   [B + 1] int32: sequence b's query tokens are rows cu[b]:cu[b+1]
    seq_lens       [B] int32: context length of b including this step's tokens
    block_tables   [B, max_blocks] int32
    seq_order      [B] int32 or None: the sequences longest first (decode steps), the order
                   attention's programs take them in, so the GPU ends with short ones
    """

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    seq_order: torch.Tensor | None = None


class Attention(nn.Module):
    """One layer's attention. sliding_window (keys older than the last W positions are not
    seen) and softcap (c * tanh(score / c)) are per layer: Gemma 3 mixes windowed and global
    layers."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        ops: KernelOps,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        self.sliding_window = sliding_window
        self.softcap = softcap
        # Per-tensor scales of an fp8 KV cache (stored = value / scale); unused otherwise.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H * D]."""
        key_cache, value_cache = kv_cache
        self.ops.store_kv(
            k, v, key_cache, value_cache, meta.slot_mapping, self.k_scale, self.v_scale
        )
        return self.attend(q, kv_cache, meta)

    def attend(
        self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D] over the cache, this step's K/V already in it -> [T, H * D]."""
        key_cache, value_cache = kv_cache
        out = self.ops.unified_attention(
            q,
            key_cache,
            value_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            seq_order=meta.seq_order,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
