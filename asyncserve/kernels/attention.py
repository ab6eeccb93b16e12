"""Triton unified paged attention's launches: prefill chunks and decodes of one step in one
launch (the kernel and its layout of the work: kernels/attention_kernel.py).

`unified_attention` picks the tiles, the split-KV factor and the decode order from the
step's shapes (kernels/attention_config.py), with no device read; `paged_attention` takes
them explicitly (tests and benchmarks) and merges split-KV partial results
(kernels/split_kv_merge.py).
"""

from __future__ import annotations

import torch
import triton

from asyncserve.kernels.attention_config import (
    AttentionConfig,
    _num_sms,
    choose_num_splits,
    default_config,
    keeps_seq_order,
    large_shared_memory,
)
from asyncserve.kernels.attention_config import block_q as query_tokens_per_program
from asyncserve.kernels.attention_kernel import _LOG2E, _unified_attention_kernel
from asyncserve.kernels.pdl import pdl_enabled, pdl_launch
from asyncserve.kernels.split_kv_merge import merge_splits

__all__ = ["AttentionConfig", "choose_num_splits", "default_config", "paged_attention",
           "unified_attention"]  # fmt: skip

# The grid runs over KV heads first: a sequence's heads start together, reading neighbouring
# bytes of its cache blocks ([block, slot, head, dim]). benchmarks/bench_kernels.py --order
# flips it to compare.
HEADS_FIRST = True
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    config: AttentionConfig,
    num_splits: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """unified_attention with explicit tiles and split-KV factor (tests and benchmarks);
    `seq_order` only when no sequence has more query tokens than a q-block holds
    (keeps_seq_order)."""
    fp8_kv = key_cache.dtype == torch.float8_e4m3fn
    if not fp8_kv:
        k_scale = v_scale = 1.0
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_head_dim != head_dim or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not match "
            f"query head dim {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache need a contiguous last dimension")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    block_m = max(config.block_m, triton.next_power_of_2(group))  # rows of a program
    block_q = query_tokens_per_program(config, group)
    if seq_order is not None and seq_order.shape != (num_seqs,):
        raise ValueError(f"seq_order of shape {tuple(seq_order.shape)} for {num_seqs} sequences")
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    part_acc = part_max = part_sum = out  # placeholders: only split-KV launches write them
    if num_splits > 1:
        part_max = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = query.new_empty((*part_max.shape, head_dim_pad), dtype=torch.float32)

    pdl = pdl_enabled(query.device)
    q_blocks = num_tokens // block_q + num_seqs  # upper bound on q-blocks over all sequences
    heads_first = HEADS_FIRST and q_blocks <= _MAX_GRID_Y
    grid = (
        (num_kv_heads, q_blocks, num_splits)
        if heads_first
        else (q_blocks, num_kv_heads, num_splits)
    )
    _unified_attention_kernel[grid](
        out,  # [T, H, D]
        part_acc,  # [T, H, S, Dp] fp32
        part_max,  # [T, H, S] fp32
        part_sum,  # [T, H, S] fp32
        query,  # [T, H, D]
        key_cache,  # [num_blocks, block_size, Hkv, D]
        value_cache,  # [num_blocks, block_size, Hkv, D]
        cu_seqlens_q,  # [B + 1] int32
        seq_lens,  # [B] int32
        block_tables,  # [B, max_blocks_per_seq] int32
        seq_order if seq_order is not None else seq_lens,  # [B] int32 (ORDERED only)
        scale * k_scale * _LOG2E,  # qk_scale (an fp8 cache's K scale folded in)
        sliding_window or 0,  # W
        softcap or 0.0,  # c
        num_seqs,  # B
        num_heads,  # H
        query.stride(0),  # stride_q_tok
        query.stride(1),  # stride_q_head
        out.stride(0),  # stride_o_tok
        out.stride(1),  # stride_o_head
        key_cache.stride(0),  # stride_k_block (may exceed 2**31)
        key_cache.stride(1),  # stride_k_slot
        key_cache.stride(2),  # stride_k_head
        value_cache.stride(0),  # stride_v_block
        value_cache.stride(1),  # stride_v_slot
        value_cache.stride(2),  # stride_v_head
        block_tables.stride(0),  # stride_bt_seq
        GROUP=group,  # H // Hkv
        HEAD_DIM=head_dim,  # D
        HEAD_DIM_PAD=head_dim_pad,  # pow2 >= D
        BLOCK_SIZE=block_size,  # tokens per cache block
        BLOCK_M=block_m,  # rows per program
        BLOCK_Q=block_q,  # query tokens per program
        TILE_N=config.tile_n,  # keys per iteration
        NUM_SPLITS=num_splits,  # split-KV factor
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        IEEE_DOT=query.dtype == torch.float32,  # exact fp32 dots for fp32 inputs
        UPCAST=query.device.type != "cuda",  # interpreter on CPU tensors
        v_scale=v_scale,
        FP8_KV=fp8_kv,
        PDL=pdl,
        HEADS_FIRST=heads_first,
        ORDERED=seq_order is not None,
        PREFETCH_LINES=max(1, head_dim_pad * key_cache.element_size() // 128),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch(pdl),
    )
    if num_splits > 1:
        merge_splits(out, part_acc, part_max, part_sum, pdl)
    return out


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a batch mixing prefill chunks and decodes.

    Same arguments and result as reference.unified_attention. max_seqlen_q / max_seqlen_k
    pick the tiles and the split-KV factor; when absent, shape-derived upper bounds are used
    (no device-to-host sync). seq_order ([B] int32, the sequences longest first) orders the
    programs of a decode batch, as keeps_seq_order allows.
    """
    num_tokens, num_heads, _ = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if max_seqlen_q is None:
        max_seqlen_q = num_tokens
    if max_seqlen_k is None:
        max_seqlen_k = block_tables.shape[1] * block_size
    if sliding_window is not None:
        # Split-KV is sized by the keys a query reads, which the window bounds.
        max_seqlen_k = min(max_seqlen_k, sliding_window + max_seqlen_q)
    config = default_config(
        num_heads // max(1, num_kv_heads),
        max_seqlen_q,
        query.shape[-1],
        # The head-dim-256 tiles were swept in bf16; fp32 tiles are twice the bytes.
        large_shared_memory(query.device) and query.element_size() == 2,
    )
    num_sms = _num_sms(query.device)
    num_splits = choose_num_splits(
        seq_lens.shape[0], num_kv_heads, max_seqlen_q, max_seqlen_k, config, num_sms
    )
    if seq_order is not None:
        programs = seq_lens.shape[0] * num_kv_heads * num_splits
        group = num_heads // max(1, num_kv_heads)
        if not keeps_seq_order(config, group, max_seqlen_q, programs, num_sms):
            seq_order = None
    return paged_attention(
        query,
        key_cache,
        value_cache,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        scale,
        config,
        num_splits,
        sliding_window,
        softcap,
        k_scale,
        v_scale,
        seq_order,
    )
