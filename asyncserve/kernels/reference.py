"""Pure-torch references of every kernel; also the CPU path.

The Triton kernels in this package take exactly these arguments and return exactly these
results, so the model runner swaps one for the other by device.

Shapes (T = tokens in the step, B = sequences, D = head dim):
  query            [T, num_heads, D]
  key, value       [T, num_kv_heads, D]
  key_cache        [num_blocks, block_size, num_kv_heads, D]   (value_cache the same)
  slot_mapping     [T] int64: block_id * block_size + offset; -1 means "do not store" (padding)
  cu_seqlens_q     [B + 1] int32: query tokens of sequence b are query[cu[b]:cu[b+1]]
  seq_lens         [B] int32: context length of sequence b including this step's tokens
  block_tables     [B, max_blocks_per_seq] int32
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat_k.index_copy_(0, slots, key[valid].to(key_cache.dtype))
    flat_v.index_copy_(0, slots, value[valid].to(value_cache.dtype))


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """Causal attention of a batch mixing prefill chunks and decodes over the paged cache.

    Query token i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to
    every cached key at positions <= its own. The K/V of this step's tokens must already be
    stored. max_seqlen_* are hints for kernels; the reference ignores them.
    """
    del max_seqlen_q, max_seqlen_k
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, ctx_len in enumerate(lens):
        q_start, q_end = cu[b], cu[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_ctx_blocks = (ctx_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_ctx_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        q = query[q_start:q_end]
        # [heads, tokens, D] in fp32 for a precise reference.
        qh = q.transpose(0, 1).float()
        kh = k.transpose(0, 1).float()
        vh = v.transpose(0, 1).float()
        mask = None
        if q_len > 1:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            k_pos = torch.arange(ctx_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, computed in fp32 as HF does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate-half) rotary embedding.

    cos_sin_cache: [max_position, rotary_dim] with cos in the first half, sin in the second.
    query [T, H, D], key [T, Hkv, D]; the first rotary_dim dims of each head rotate.
    """
    cos_sin = cos_sin_cache[positions.long()]
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., : 2 * half].float()
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if 2 * half == x.shape[-1]:
            return out
        return torch.cat((out, x[..., 2 * half :]), dim=-1)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
