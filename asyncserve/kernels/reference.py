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

Attention options shared by every attention kernel:
  sliding_window   None, or W: a query at position p sees only keys at positions > p - W
  softcap          None, or c: scores become c * tanh(score / c) before the softmax (Gemma)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its slot of the paged cache. An fp8 cache stores
    value / scale (saturated to the e4m3 range); k_scale / v_scale are ignored otherwise."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k = _to_cache(key[valid], key_cache.dtype, k_scale)
    v = _to_cache(value[valid], value_cache.dtype, v_scale)
    if key_cache.dtype == torch.float8_e4m3fn:  # no index_copy_ for fp8 on the CPU: bytes
        flat_k, flat_v = flat_k.view(torch.uint8), flat_v.view(torch.uint8)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp(-448.0, 448.0).to(dtype)


def _from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cached K or V as fp32 (an fp8 cache times its scale)."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    return x.float() * scale


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
    """Causal attention of a batch mixing prefill chunks and decodes over the paged cache
    (an fp8 cache is read times k_scale / v_scale).

    Query token i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to
    every cached key at positions <= its own (and inside the sliding window, if any). The K/V
    of this step's tokens must already be stored. max_seqlen_* and seq_order (the order of
    a kernel's programs) are hints for kernels; the reference ignores them.
    """
    del max_seqlen_q, max_seqlen_k, seq_order
    options = AttentionOptions(sliding_window, softcap, k_scale, v_scale)
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    if len(decodes) > 1:
        _decode_attention(
            query, key_cache, value_cache, cu, lens, block_tables, scale, decodes, out, options
        )
        done = set(decodes)
    else:
        done = set()
    for b, ctx_len in enumerate(lens):
        if b in done or q_lens[b] == 0:
            continue
        q_start, q_end = cu[b], cu[b + 1]
        k, v = _gather_context(key_cache, value_cache, block_tables[b], ctx_len)
        k, v = _from_cache(k, k_scale), _from_cache(v, v_scale)
        out[q_start:q_end] = _attend(query[q_start:q_end], k, v, ctx_len, scale, options)
    return out


def _gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_row: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ctx_len cached K and V of one sequence: [ctx_len, num_kv_heads, D] each."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    blocks = block_row[: (ctx_len + block_size - 1) // block_size].long()
    k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
    v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
    return k, v


class AttentionOptions(NamedTuple):
    sliding_window: int | None
    softcap: float | None
    k_scale: float = 1.0
    v_scale: float = 1.0


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_len: int,
    scale: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """Causal attention of q_len query tokens at the end of a ctx_len context, in fp32."""
    q_len, num_heads, _ = q.shape
    mask = None
    if q_len > 1 or options.sliding_window is not None:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        mask = _visible(q_pos[:, None], k_pos[None, :], options.sliding_window)
    o = _sdpa(
        q.transpose(0, 1).float(),
        k.transpose(0, 1).float(),
        v.transpose(0, 1).float(),
        mask,
        scale,
        options.softcap,
    )
    return o.transpose(0, 1).to(q.dtype)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, and within the last `window` positions."""
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [..., H, Q, D], k and v [..., Hkv, K, D] (fp32) -> [..., H, Q, D]."""
    num_heads, num_kv_heads = q.shape[-3], k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    # SDPA has no soft-capping: the scores are formed explicitly.
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=-3)
    v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def _decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu: list[int],
    lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
    decodes: list[int],
    out: torch.Tensor,
    options: AttentionOptions,
) -> None:
    """Every one-token sequence in one batched call: contexts padded to the longest, masked."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    rows = torch.tensor([cu[b] for b in decodes], device=query.device)
    ctx = torch.tensor([lens[b] for b in decodes], device=query.device)
    max_ctx = int(max(lens[b] for b in decodes))
    num_blocks = (max_ctx + block_size - 1) // block_size
    blocks = block_tables[torch.tensor(decodes, device=query.device), :num_blocks].long()
    # Columns past a sequence's context may hold anything: read block 0 there instead.
    used = torch.arange(num_blocks, device=query.device)[None, :] * block_size < ctx[:, None]
    blocks = torch.where(used, blocks, 0)
    n = len(decodes)
    k_pos = torch.arange(max_ctx, device=query.device)[None, :]
    valid = k_pos < ctx[:, None]
    # The window hides old keys from the query; they stay finite, so no zeroing needed.
    visible = (
        valid
        if options.sliding_window is None
        else valid & (k_pos >= ctx[:, None] - options.sliding_window)
    )
    # Zero the padding so 0-weight x NaN/inf in unused slots cannot reach the output.
    pad = ~valid[:, :, None, None]
    # index_select on the flat block list: much faster on CPU than advanced indexing.
    flat = blocks.reshape(-1)
    k = key_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim)[:, :max_ctx]
    v = value_cache.index_select(0, flat).view(n, -1, num_kv_heads, head_dim)[:, :max_ctx]
    k = _from_cache(k, options.k_scale).masked_fill(pad, 0)
    v = _from_cache(v, options.v_scale).masked_fill(pad, 0)
    o = _sdpa(
        query[rows].float()[:, :, None, :],  # [n, H, 1, D]
        k.transpose(1, 2).float(),  # [n, Hkv, ctx, D]
        v.transpose(1, 2).float(),
        visible[:, None, None, :],
        scale,
        options.softcap,
    )
    out[rows] = o[:, :, 0, :].to(query.dtype)


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


def sum_parts(parts: torch.Tensor) -> torch.Tensor:
    """Split-K partial sums [P, ...] added in split order (as split_k.sum_splits adds them)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def add_parts_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm of x = the fp32 partial sums `parts` [P, ...] added in order and
    rounded to the residual's dtype."""
    return fused_add_rms_norm(sum_parts(parts).to(residual.dtype), residual, weight, eps)


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


def rope_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm of query and key (when the weights are given), rotary on both, then
    key and value into the cache: rms_norm, rotary_embedding and store_kv in turn. Returns
    the rotated query. [P, T, heads, D] fp32 partial sums for query, key and value stand for
    their in-order sums rounded to `dtype`."""
    if query.dim() == 4:
        assert dtype is not None
        query, key, value = (sum_parts(t).to(dtype) for t in (query, key, value))
    if q_norm_weight is not None and k_norm_weight is not None:
        query = rms_norm(query, q_norm_weight, eps)
        key = rms_norm(key, k_norm_weight, eps)
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return query


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum (a NaN above any number): kernels/argmax.py."""
    return x.argmax(dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] with d = x.shape[-1] // 2."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :d], approximate="tanh") * x[..., d:] with d = x.shape[-1] // 2 (Gemma)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token: router_logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32).

    Scores are softmax (Mixtral, Qwen-MoE, GraniteMoE) or sigmoid over the logits, in fp32;
    renormalize rescales each token's k weights to sum to 1.
    """
    logits = router_logits.float()
    if scoring == "softmax":
        scores = logits.softmax(-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"MoE router scoring {scoring!r} is not supported (softmax, sigmoid)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over each token's k experts of weight * down(silu(gate(x)) * up(x)).

    hidden [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows); w2 [E_local, H, I];
    topk_weights [T, k]; topk_ids [T, k] global expert ids. expert_map [E] int32 maps a global
    expert to its local index, or -1 for an expert another rank holds (its term is left out).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=w13.shape[0]).tolist()
    start = int((flat_ids < 0).sum())  # the other ranks' experts sort first
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start : start + count]  # flat (token, slot) indices
        start += count
        tokens = picks // top_k
        x = F.linear(hidden[tokens], w13[expert])
        y = F.linear(silu_and_mul(x), w2[expert])
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[picks, None].float())
    return out.to(hidden.dtype)


# ---- LoRA (punica-style shrink / expand over tokens grouped by adapter slot) -------------
#
#   sorted_tokens  [T] int32: token rows ordered by adapter slot (rows without one left out)
#   group_slots    [G] int32: the slot of group g; -1 marks an unused group
#   group_starts   [G + 1] int32: group g's rows are sorted_tokens[starts[g]:starts[g + 1]]
#   lora_a         [S, R, in]   lora_b [S, out, R]   (S slots, R = max rank, zero-padded)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    sorted_tokens: torch.Tensor,
    group_slots: torch.Tensor,
    group_starts: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t] = x[t] @ lora_a[slot(t)]^T for every row in a group, in fp32 ([T, R]).
    Rows in no group are left as they are."""
    starts = group_starts.tolist()
    for g, slot in enumerate(group_slots.tolist()):
        if slot < 0 or starts[g + 1] <= starts[g]:
            continue
        rows = sorted_tokens[starts[g] : starts[g + 1]].long()
        out[rows] = (x[rows].float() @ lora_a[slot].float().t()).to(out.dtype)


def lora_expand(
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    sorted_tokens: torch.Tensor,
    group_slots: torch.Tensor,
    group_starts: torch.Tensor,
    y: torch.Tensor,
    offset: int,
) -> None:
    """y[t, offset:offset + out] += buf[t] @ lora_b[slot(t)]^T for every row in a group, in
    place, summed in fp32 and rounded to y's dtype once."""
    width = lora_b.shape[1]
    starts = group_starts.tolist()
    for g, slot in enumerate(group_slots.tolist()):
        if slot < 0 or starts[g + 1] <= starts[g]:
            continue
        rows = sorted_tokens[starts[g] : starts[g + 1]].long()
        delta = buf[rows].float() @ lora_b[slot].float().t()
        target = y[rows, offset : offset + width]
        y[rows, offset : offset + width] = (target.float() + delta).to(y.dtype)
