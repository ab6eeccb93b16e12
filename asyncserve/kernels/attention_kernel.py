"""Triton unified paged attention: prefill chunks and decodes of one step in one launch.

Layout of the work. The query heads that share one KV head (the GQA group) are stacked
with consecutive query tokens into the rows of one tile: row m of a program is query token
``m // GROUP`` of its q-block and query head ``kv_head * GROUP + m % GROUP``. One program
owns BLOCK_Q query tokens of one sequence for one KV head, so every K/V tile it loads
from the paged cache serves all the query heads of that KV head at once.

Programs find their sequence without a host sync: q-block ``i`` of sequence ``b`` has the
global index ``cu_seqlens_q[b] // BLOCK_Q + b + i``, which is increasing in ``b``, so a
binary search over ``cu_seqlens_q`` inside the kernel recovers ``b``. The grid is the upper
bound ``num_tokens // BLOCK_Q + num_seqs`` (shapes only); extra programs return at once.

Split-KV (flash-decoding): with few programs and long contexts, a third grid axis cuts
each program's key range into NUM_SPLITS parts that write unnormalised partial results
(accumulator, running max and sum, in fp32); a second kernel merges them. Output rows of
tokens past cu_seqlens_q[-1] (padding) are left unspecified, as in the reference.

A sliding window (W > 0) hides keys at positions <= p - W from a query at position p; a
program skips the key tiles that no query of its q-block can see. Soft-capping (Gemma) maps
each score s to c * tanh(s / c) before the softmax.

All cache offsets are computed in int64: ``block_id * stride`` overflows int32 on a pool
of more than 2**31 elements.
"""

from __future__ import annotations

import triton
import triton.language as tl

from asyncserve.kernels.pdl import pdl_prefetch_l2, pdl_wait

_LOG2E = 1.4426950408889634
# The same inside kernels, which read only constexpr globals.
_LOG2E_K = tl.constexpr(_LOG2E)


@triton.jit
def _find_seq_idx(cu_seqlens_q_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with cu_seqlens_q[b] // BLOCK_Q + b <= q_block_idx."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs and the block tables' width (stride_bt_seq) change every step: one compiled kernel
# for all their values, not one per Triton integer specialization (== 1, divisible by 16),
# compiled mid-run the first time each is seen.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])
def _unified_attention_kernel(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] fp32 (split-KV only)
    part_max_ptr,  # [T, H, NUM_SPLITS] fp32, log2 domain (split-KV only)
    part_sum_ptr,  # [T, H, NUM_SPLITS] fp32 (split-KV only)
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    cu_seqlens_q_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, max_blocks_per_seq] int32
    seq_order_ptr,  # [B] int32: the sequences longest first (ORDERED only)
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # W: keys at positions <= p - W are hidden (SLIDING only)
    softcap,  # c of c * tanh(s / c) (SOFTCAP only)
    num_seqs,
    num_heads,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows per program (BLOCK_Q tokens x GROUP heads, padded)
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per iteration
    NUM_SPLITS: tl.constexpr,  # 1: write the output; >1: write partials for the merge
    SLIDING: tl.constexpr,  # a sliding window applies
    SOFTCAP: tl.constexpr,  # scores are soft-capped
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
    UPCAST: tl.constexpr,  # Triton's CPU interpreter: dot operands in fp32 (numpy has no bf16)
    v_scale,  # fp8 caches: V's per-tensor scale (K's is folded into qk_scale)
    FP8_KV: tl.constexpr,  # the caches are e4m3: tiles widen to the query's dtype
    PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
    HEADS_FIRST: tl.constexpr,  # grid (KV heads, q-blocks, splits) instead of (q-blocks, ...)
    ORDERED: tl.constexpr,  # one q-block a sequence, q-block i serving seq_order[i]
    PREFETCH_LINES: tl.constexpr = 0,  # 128-byte lines a key row (PDL's prefetch; 0: none)
):
    # Before the wait (kernels/pdl.py) only what no kernel of this step writes: the batch's
    # layout (sequence lengths, block tables) and the cache lines of this program's first
    # key tile, prefetched into L2 (the kernel before may still be writing this step's keys
    # there: L2 is where its writes land, so the loads after the wait see them). The query
    # is that kernel's output: read after the wait.
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        q_block = tl.program_id(1)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if ORDERED:
        # Longest sequences first: the last programs the GPU starts are the shortest, so
        # none is left running long after the others (ragged decode batches).
        if q_block >= num_seqs:
            return
        seq = tl.load(seq_order_ptr + q_block)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        q_block_local = 0
    else:
        seq = _find_seq_idx(cu_seqlens_q_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        q_block_local = q_block - (q_start // BLOCK_Q + seq)
        if q_block_local * BLOCK_Q >= q_len:
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_local < q_len)
    q_pos = ctx_len + q_local  # absolute position of each row's query token
    tok = (q_start + q_local).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM

    # Keys this q-block can see: up to its last query token (causal), at most seq_len.
    kv_end = tl.minimum(seq_len, ctx_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    first_tile = 0
    if SLIDING:
        # The q-block's first query sees keys from its position - W + 1 on; later ones less.
        first_key = tl.maximum(ctx_len + q_block_local * BLOCK_Q - sliding_window + 1, 0)
        first_tile = first_key // TILE_N
    if NUM_SPLITS == 1:
        tile_lo = first_tile
        tile_hi = num_tiles
    else:
        per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head_off = kv_head.to(tl.int64) * stride_k_head
    v_head_off = kv_head.to(tl.int64) * stride_v_head
    offs_n = tl.arange(0, TILE_N)
    if PDL and PREFETCH_LINES > 0:  # noqa: SIM102 (a constexpr test: compiled out when off)
        if tile_lo < tile_hi:
            # Each key's K and V rows, PREFETCH_LINES lines of 128 bytes each; keys past the
            # end read the last key's lines.
            k_pos = tl.minimum(tile_lo * TILE_N + offs_n, kv_end - 1)
            block_id = tl.load(block_table_row + k_pos // BLOCK_SIZE).to(tl.int64)
            slot = (k_pos % BLOCK_SIZE).to(tl.int64)
            lines = (tl.arange(0, PREFETCH_LINES) * (HEAD_DIM_PAD // PREFETCH_LINES))[None, :]
            k_rows = block_id * stride_k_block + slot * stride_k_slot + k_head_off
            v_rows = block_id * stride_v_block + slot * stride_v_slot + v_head_off
            pdl_prefetch_l2(key_cache_ptr + k_rows[:, None] + lines, PDL)
            pdl_prefetch_l2(value_cache_ptr + v_rows[:, None] + lines, PDL)
    pdl_wait(PDL)

    q = tl.load(
        query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        k_pos = tile * TILE_N + offs_n
        k_valid = k_pos < kv_end
        block_id = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        block_id = block_id.to(tl.int64)
        slot = (k_pos % BLOCK_SIZE).to(tl.int64)
        k_off = block_id * stride_k_block + slot * stride_k_slot + k_head_off
        v_off = block_id * stride_v_block + slot * stride_v_slot + v_head_off
        k = tl.load(
            key_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=k_valid[None, :] & d_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        if FP8_KV:
            k = k.to(query_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") if IEEE_DOT else tl.dot(q, k)
        if SOFTCAP:
            # c * tanh(x / c) with tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both infinities.
            s = s * (qk_scale / _LOG2E_K) / softcap
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * _LOG2E_K
        else:
            s = s * qk_scale  # [BLOCK_M, TILE_N] fp32
        visible = k_pos[None, :] <= q_pos[:, None]
        if SLIDING:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no key yet keep -inf; shift them by 0 to avoid inf - inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            value_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=k_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        if FP8_KV:
            v = v.to(query_ptr.dtype.element_ty)
            p_dot = p.to(query_ptr.dtype.element_ty)
        else:
            p_dot = p.to(value_cache_ptr.dtype.element_ty)  # rounded like the compiled kernel
        if UPCAST:
            v = v.to(tl.float32)
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(p_dot, v, acc, input_precision="ieee") if IEEE_DOT else tl.dot(p_dot, v, acc)
        m_i = m_new

    if FP8_KV:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        part = (tok * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M] int64
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
