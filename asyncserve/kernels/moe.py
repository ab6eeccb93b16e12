"""Triton fused mixture-of-experts: router top-k, expert-sorted grouped GEMMs.

The flow of one MoE layer (same results as reference.moe_route and reference.fused_moe):

1. moe_route: one program per token takes softmax (or sigmoid) over the router logits, picks
   the top k experts and optionally renormalises their weights.
2. align_by_expert: the T * k (token, slot) pairs are sorted by expert, and each expert's run
   is padded to a multiple of BLOCK_M, so one BLOCK_M row tile of the sorted list belongs to
   exactly one expert (kernels/moe_align.py: one kernel for decode batches, torch operations
   for more pairs; no host sync, buffers sized by upper bounds).
3. gate_up GEMM: each tile multiplies its tokens' hidden rows by its expert's gate and up
   rows at once and writes silu(gate) * up (the activation is fused in the epilogue).
4. down GEMM: each tile multiplies those activations by its expert's down projection and
   scales each row by its routing weight; the k rows of a token are then summed.

Tile sizes come from the tuned per-shape, per-GPU tables of moe_config.py.

FP8 experts (w13_scale / w2_scale given; layout in quant_reference.fused_moe_fp8): the
GEMMs' inputs are quantized per token (group) first, and each k-tile's fp8 dot is scaled by
its activation and weight scales before it is added (one scale group per tile: BLOCK_K
divides the group), so per-channel and block scales are one code path.

Expert parallelism: with an expert_map (global expert -> local index, -1 elsewhere) pairs
routed to another rank's experts are sorted into no tile and contribute zero; the caller
reduces the partial sums over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncserve.kernels.moe_align import align_by_expert
from asyncserve.kernels.moe_config import MoEConfig, choose_config, device_name, dtype_name
from asyncserve.kernels.parallel_compiles import compiling_only


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] fp32
    ids_ptr,  # [T, TOP_K] int32
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of 2 of TOP_K
    E_PAD: tl.constexpr,  # next power of 2 of num_experts
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    valid = offs_e < num_experts
    x = tl.load(logits_ptr + tok * stride_logits + offs_e, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        e = tl.exp(x - tl.max(x, 0))
        scores = e / tl.sum(e, 0)
    # Scores are >= 0: -1 marks padding and experts already taken.
    scores = tl.where(valid, scores, -1.0)
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    top_i = tl.zeros([K_PAD], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(scores, 0)
        # Lowest index among equal scores.
        best_i = tl.min(tl.where(scores == best, offs_e, E_PAD), 0)
        top_w = tl.where(offs_k == slot, best, top_w)
        top_i = tl.where(offs_k == slot, best_i, top_i)
        scores = tl.where(offs_e == best_i, -1.0, scores)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    keep = offs_k < TOP_K
    tl.store(weights_ptr + tok * TOP_K + offs_k, top_w, mask=keep)
    tl.store(ids_ptr + tok * TOP_K + offs_k, top_i, mask=keep)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as reference.moe_route."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"MoE router scoring {scoring!r} is not supported (softmax, sigmoid)")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = router_logits.new_empty((num_tokens, top_k), dtype=torch.float32)
    ids = router_logits.new_empty((num_tokens, top_k), dtype=torch.int32)
    if num_tokens == 0:
        return weights, ids
    _route_kernel[(num_tokens,)](
        router_logits,  # [T, E]
        weights,  # [T, k] fp32
        ids,  # [T, k] int32
        num_experts,  # E
        router_logits.stride(0),  # stride_logits
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        SIGMOID=scoring == "sigmoid",
        RENORMALIZE=renormalize,
        num_warps=1,
    )
    if compiling_only():  # not launched: torch operations index with these ids
        ids.zero_()
        weights.fill_(1.0 / top_k)
    return weights, ids


# Counts that change every step are not specialized on (one compile, not one per value class).
@triton.jit(do_not_specialize=["num_pairs", "num_tiles_m"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: hidden states (row = pair // A_DIV) or activations (row = pair)
    b_ptr,  # [E, N or 2N, K]: expert weights, out_features x in_features
    c_ptr,  # [T * k, N]: one row per (token, slot) pair
    weights_ptr,  # [T * k] fp32 routing weights (MUL_WEIGHT only)
    a_scale_ptr,  # [rows, K groups] fp32 (FP8 only)
    b_scale_ptr,  # [E, N or 2N row groups, K groups] fp32 (FP8 only)
    sorted_ids_ptr,  # [max_len] int32
    tile_experts_ptr,  # [max_len // BLOCK_M] int32
    num_sorted_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    stride_a,
    stride_be,
    stride_bn,
    stride_c,
    num_tiles_m,
    stride_as,
    stride_bse,
    stride_bsn,
    up_scale_row,  # the first scale row of the up half (GATED and FP8)
    A_DIV: tl.constexpr,  # pairs per row of a (top_k for the hidden states, 1 otherwise)
    GATED: tl.constexpr,  # b holds gate rows then up rows: write silu(gate) * up
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
    UPCAST: tl.constexpr,  # Triton's CPU interpreter: dot operands in fp32
    FP8: tl.constexpr,
    GROUP_N: tl.constexpr,  # weight rows per scale (FP8)
    GROUP_K: tl.constexpr,  # input columns per scale (FP8)
):
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each column tile of the weights while in cache.
    per_group = GROUP_M * num_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_size
    tile_n = (pid % per_group) // group_size
    if tile_m * BLOCK_M >= tl.load(num_sorted_ptr):
        return
    expert = tl.load(tile_experts_ptr + tile_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_valid = pair < num_pairs
    a_row = (pair // A_DIV).to(tl.int64)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    b_base = b_ptr + expert * stride_be

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        a = tl.load(
            a_ptr + a_row[:, None] * stride_a + offs_k[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        b_mask = k_valid[:, None] & n_valid[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None], mask=b_mask, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if FP8:
            group = k0 // GROUP_K
            a_s = tl.load(a_scale_ptr + a_row * stride_as + group, mask=row_valid, other=0.0)
            bs_base = b_scale_ptr + expert * stride_bse + group
            b_s = tl.load(bs_base + (offs_n // GROUP_N) * stride_bsn, mask=n_valid, other=0.0)
            part = tl.dot(a, b, input_precision="ieee") if UPCAST else tl.dot(a, b)
            acc += part * a_s[:, None] * b_s[None, :]
            if GATED:
                b_up = tl.load(
                    b_base + (offs_n + N)[None, :] * stride_bn + offs_k[:, None],
                    mask=b_mask,
                    other=0.0,
                )
                if UPCAST:
                    b_up = b_up.to(tl.float32)
                up_rows = up_scale_row + offs_n // GROUP_N
                b_s_up = tl.load(bs_base + up_rows * stride_bsn, mask=n_valid, other=0.0)
                part = tl.dot(a, b_up, input_precision="ieee") if UPCAST else tl.dot(a, b_up)
                acc_up += part * a_s[:, None] * b_s_up[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE_DOT else tl.dot(a, b, acc)
        if GATED and not FP8:
            b_up = tl.load(
                b_base + (offs_n + N)[None, :] * stride_bn + offs_k[:, None],
                mask=b_mask,
                other=0.0,
            )
            if UPCAST:
                b_up = b_up.to(tl.float32)
            if IEEE_DOT:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(
        c_ptr + pair.to(tl.int64)[:, None] * stride_c + offs_n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_valid[:, None] & n_valid[None, :],
    )


@dataclass(frozen=True)
class _Fp8Operands:
    """An FP8 GEMM's scales: a_scale [rows, ceil(K / group_k)] for the e4m3 input, b_scale
    [E, row groups, K groups] for the expert weights (group_n rows, group_k columns each)."""

    a_scale: torch.Tensor
    b_scale: torch.Tensor
    group_n: int
    group_k: int


def _quantize_input(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    from asyncserve.kernels.fp8_gemm import per_token_group_quant_fp8

    return per_token_group_quant_fp8(x, group)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_div: int,
    gated: bool,
    config: MoEConfig,
    fp8: _Fp8Operands | None = None,
) -> None:
    sorted_ids, tile_experts, num_sorted = align
    n = c.shape[1]
    num_tiles_m = tile_experts.shape[0]
    grid = (num_tiles_m * triton.cdiv(n, config.block_n),)
    block_k = config.block_k
    if fp8 is not None:
        block_k = min(block_k, fp8.group_k)  # one scale group per k-tile
    _moe_gemm_kernel[grid](
        a,  # [rows, K]
        b,  # [E, N or 2N, K]
        c,  # [T * k, N]
        topk_weights if topk_weights is not None else c,  # [T * k] fp32
        fp8.a_scale if fp8 is not None else c,  # [rows, K groups] fp32
        fp8.b_scale if fp8 is not None else c,  # [E, row groups, K groups] fp32
        sorted_ids,  # [max_len] int32
        tile_experts,  # [max_len // BLOCK_M] int32
        num_sorted,  # [1] int32
        n,  # N
        a.shape[1],  # K
        c.shape[0],  # num_pairs
        a.stride(0),  # stride_a
        b.stride(0),  # stride_be
        b.stride(1),  # stride_bn
        c.stride(0),  # stride_c
        num_tiles_m,
        fp8.a_scale.stride(0) if fp8 is not None else 0,  # stride_as
        fp8.b_scale.stride(0) if fp8 is not None else 0,  # stride_bse
        fp8.b_scale.stride(1) if fp8 is not None else 0,  # stride_bsn
        fp8.b_scale.shape[1] // 2 if fp8 is not None else 0,  # up_scale_row
        A_DIV=a_div,
        GATED=gated,
        MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        GROUP_M=config.group_m,
        IEEE_DOT=a.dtype == torch.float32,
        UPCAST=a.device.type != "cuda",
        FP8=fp8 is not None,
        GROUP_N=fp8.group_n if fp8 is not None else 1,
        GROUP_K=fp8.group_k if fp8 is not None else 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    config: MoEConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Same arguments and result as reference.fused_moe; config overrides the tuned table
    (moe_config.py). With w13_scale and w2_scale, w13 and w2 are e4m3 and the result is
    quant_reference.fused_moe_fp8's (block: the scales' [bn, bk] tiles, None per channel)."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, intermediate):
        raise ValueError(
            f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden size "
            f"{hidden_size}"
        )
    out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    if config is None:
        config = choose_config(
            num_tokens,
            num_experts,
            intermediate,
            dtype_name(hidden.dtype),
            device_name(hidden.device),
        )
    hidden = hidden.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    align = align_by_expert(topk_ids, config.block_m, num_experts, expert_map)
    num_pairs = num_tokens * top_k
    # Pairs sent to another rank's experts are never written: they must read as zero.
    new = torch.zeros if expert_map is not None else torch.empty
    act = new((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    down = new((num_pairs, hidden_size), dtype=hidden.dtype, device=hidden.device)
    a, fp8_13, fp8_2 = hidden, None, None
    if w13_scale is not None and w2_scale is not None:
        # Per channel: one group spanning K (a power of two, so that it caps no k-tile).
        group_n, group_13 = block if block is not None else (1, hidden_size)
        group_2 = block[1] if block is not None else intermediate
        a, a_scale = _quantize_input(hidden, group_13)
        tile_13 = group_13 if block else triton.next_power_of_2(group_13)
        tile_2 = group_2 if block else triton.next_power_of_2(group_2)
        fp8_13 = _Fp8Operands(a_scale, w13_scale.float().contiguous(), group_n, tile_13)
        fp8_2 = _Fp8Operands(a_scale, w2_scale.float().contiguous(), group_n, tile_2)
    _grouped_gemm(a, w13, act, None, align, top_k, True, config, fp8_13)
    weights = topk_weights.reshape(-1).float().contiguous()
    a = act
    if fp8_2 is not None:
        a, a_scale = _quantize_input(act, group_2)
        fp8_2 = _Fp8Operands(a_scale, fp8_2.b_scale, fp8_2.group_n, fp8_2.group_k)
    _grouped_gemm(a, w2, down, weights, align, 1, False, config, fp8_2)
    torch.sum(down.view(num_tokens, top_k, hidden_size), dim=1, out=out)
    return out
