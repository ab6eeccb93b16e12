"""Pure-torch references of the quantized-matmul kernels (kernels/fp8_gemm.py,
kernels/int4_gemm.py); also the CPU path of the quantized linear layers. Each Triton kernel
takes exactly these arguments and returns these results."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- FP8 (e4m3) quantized matmuls: the references of kernels/fp8_gemm.py and the CPU path.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# A floor for scales, so an all-zero row or group quantizes to zeros instead of NaN.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / group_size)]): each token's run of
    `group_size` columns gets scale amax / 448 (group_size = K: per-token quantization)."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = F.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group_size)[:, :k], scale


def fp8_rowwise_matmul(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias, in fp32: x_q [M, K] e4m3 with x_scale
    [M, 1], w_q [N, K] e4m3 with w_scale [N, 1] (what torch._scaled_mm computes on Hopper)."""
    out = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_weight_only_matmul(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ (w_q * w_scale)^T + bias in fp32, x not quantized (the FP8 GEMV's one-token path):
    x [M, K] bf16 / fp16 / fp32, w_q [N, K] e4m3 with w_scale [N, 1] or one value."""
    out = x.float() @ (w_q.float() * w_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def dequant_fp8_blocks(
    w_q: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp32 weight from e4m3 [N, K] and one scale per [block_n, block_k] tile."""
    n, k = w_q.shape
    scale = w_scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return w_q.float() * scale[:, :k]


def w8a8_block_fp8_matmul(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Block-scaled FP8 GEMM (DeepSeek-V3 style): x_q [M, K] e4m3 with x_scale [M, K / bk]
    (one per token and group of bk columns), w_q [N, K] e4m3 with w_scale [N / bn, K / bk].
    Returns [M, N] in out_dtype."""
    k = x_q.shape[1]
    x = x_q.float() * x_scale.float().repeat_interleave(block[1], 1)[:, :k]
    return (x @ dequant_fp8_blocks(w_q, w_scale, block).t()).to(out_dtype)


# --- FP8 experts of a fused MoE: the reference of kernels/moe.py's FP8 path and the CPU path.
# w13_q [E, 2I, H] / w2_q [E, H, I] e4m3. block None: one scale per expert row ([E, 2I, 1],
# [E, H, 1]), activations quantized per token. block (bn, bk): one scale per [bn, bk] tile,
# w13's gate and up halves tiled apart ([E, 2 * ceil(I / bn), ceil(H / bk)]), activations
# per token and bk columns.


def dequant_fp8_experts(
    w_q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, halves: int
) -> torch.Tensor:
    """fp32 [E, N, K] expert weights; halves=2 for w13 (gate and up tiled apart)."""
    if block is None:
        return w_q.float() * scale.float()
    rows, scale_rows = w_q.shape[1] // halves, scale.shape[1] // halves
    parts = [
        torch.stack(
            [
                dequant_fp8_blocks(
                    w[h * rows : (h + 1) * rows], s[h * scale_rows : (h + 1) * scale_rows], block
                )
                for h in range(halves)
            ]
        ).reshape(-1, w_q.shape[2])
        for w, s in zip(w_q, scale, strict=True)
    ]
    return torch.stack(parts)


def _quant_dequant(x: torch.Tensor, group: int) -> torch.Tensor:
    q, s = per_token_group_quant_fp8(x, group)
    return q.float() * s.repeat_interleave(group, 1)[:, : x.shape[1]]


def fused_moe_fp8(
    hidden: torch.Tensor,
    w13_q: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_q: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int] | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    dequantized: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """reference.fused_moe with FP8 experts (layout above) and dynamic FP8 activations: the
    hidden states and the gate/up output (rounded to hidden's dtype first, as the kernel
    stores it) are quantized per token (group) and dequantized. `dequantized`: the fp32
    (w13, w2) from dequant_fp8_experts, when the caller keeps them."""
    from asyncserve.kernels.reference import silu_and_mul

    if dequantized is None:
        dequantized = (
            dequant_fp8_experts(w13_q, w13_scale, block, 2),
            dequant_fp8_experts(w2_q, w2_scale, block, 1),
        )
    w13, w2 = dequantized
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    x = _quant_dequant(hidden, block[1] if block else hidden.shape[1])
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    flat = ids.reshape(-1)
    for expert in range(w13.shape[0]):
        picks = (flat == expert).nonzero().squeeze(1)  # flat (token, slot) indices
        if picks.numel() == 0:
            continue
        tokens = picks // top_k
        act = silu_and_mul(x[tokens] @ w13[expert].t()).to(hidden.dtype)
        y = _quant_dequant(act, block[1] if block else act.shape[1]) @ w2[expert].t()
        out.index_add_(0, tokens, y * topk_weights.reshape(-1)[picks, None].float())
    return out.to(hidden.dtype)


# --- 4-bit weight-only (W4A16): the references of kernels/int4_gemm.py and the CPU path.
# One layout for every checkpoint format (quantization/int4.py converts to it): qweight
# int32 [N, K / 8], nibble i of word j = the unsigned 4-bit value of column 8j + i;
# scales and zeros [N, groups] (w = (q - zero) * scale), zeros None for symmetric weights
# (every zero SYMMETRIC_ZERO: the kernels then read no zeros); g_idx [K] int32, the group of
# each input column (act-order checkpoints), or None for k // group_size.
SYMMETRIC_ZERO = 8


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8-valued int32 [R, C], nibble i of word j -> column 8j + i."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0xF).reshape(*packed.shape[:-1], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The inverse of unpack_int4: [R, C] values in 0..15 -> int32 [R, C / 8]."""
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = torch.zeros(v.shape[:-1], dtype=torch.int64, device=values.device)
    for i in range(8):
        words |= v[..., i] << (4 * i)
    # The top nibble lands in the sign bit: wrap to int32's two's complement.
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequant_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """fp32 [N, K] weight from the int4 layout above."""
    q = unpack_int4(qweight).float()
    k = q.shape[1]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    zero = SYMMETRIC_ZERO if zeros is None else zeros.float()[:, groups]
    return (q - zero) * scales.float()[:, groups]


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x [M, K] @ dequant_int4(...)^T in fp32, returned in x's dtype."""
    w = dequant_int4(qweight, scales, zeros, g_idx, group_size)
    return (x.float() @ w.t()).to(x.dtype)


# GGUF blocks (quantization/gguf.py) repacked: qweight int8 [N, K] (8-bit) or the int4 layout
# above (4-bit, unsigned); scale and minimum [N, K / super_block] fp16; for k-quants 6-bit
# sub-block factors [N, K / 32] (uint8). w = (scale * sub_scale) * q - (minimum * sub_min),
# in fp32 and in the order gguf's own dequantizers use, so the weights are bit-identical.
GGUF_SUB_BLOCK = 32


def dequant_gguf(
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    sub_scale: torch.Tensor | None,
    sub_min: torch.Tensor | None,
    super_block: int,
) -> torch.Tensor:
    """fp32 [N, K] weight from the repacked GGUF layout above."""
    q = qweight.float() if qweight.dtype == torch.int8 else unpack_int4(qweight).float()
    n, k = q.shape
    per_super = super_block // GGUF_SUB_BLOCK
    s = scale.float().repeat_interleave(per_super, dim=1)  # [N, K / 32]
    if sub_scale is not None:
        s = s * sub_scale.float()
    w = s[:, :, None] * q.view(n, -1, GGUF_SUB_BLOCK)
    if minimum is not None:
        mn = minimum.float().repeat_interleave(per_super, dim=1)
        if sub_min is not None:
            mn = mn * sub_min.float()
        w = w - mn[:, :, None]
    return w.reshape(n, k)


def gguf_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    sub_scale: torch.Tensor | None,
    sub_min: torch.Tensor | None,
    super_block: int,
) -> torch.Tensor:
    """x [M, K] @ dequant_gguf(...)^T in fp32, returned in x's dtype."""
    w = dequant_gguf(qweight, scale, minimum, sub_scale, sub_min, super_block)
    return (x.float() @ w.t()).to(x.dtype)
