"""Fused MoE with FP8 experts (Triton) equals quant_reference.fused_moe_fp8: per-channel and
block scales, one token, experts with no token, expert parallelism; and the reference stays
close to the unquantized reference.fused_moe."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import quant_reference, reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import moe  # noqa: E402
from tests.kernels.paged_batch import rel_err  # noqa: E402

SMALL = moe.MoEConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
FP8 = quant_reference.FP8_DTYPE


@pytest.fixture(autouse=True)
def exact_quantizer(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the GEMMs read activations quantized by the reference: the interpreter's fp8
    cast drops a carry now and then (test_fp8_gemm covers the Triton quantizer), which
    would move a few activations by one binade and hide the GEMMs' own error."""
    if device.type != "cuda":
        monkeypatch.setattr(moe, "_quantize_input", quant_reference.per_token_group_quant_fp8)


def quantize_experts(
    w: torch.Tensor, block: tuple[int, int] | None, halves: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3, scales) in fused_moe_fp8's layout (gate and up tiled apart)."""
    if block is None:
        scale = (w.abs().amax(dim=2, keepdim=True) / quant_reference.FP8_MAX).clamp(min=1e-12)
        return (w / scale).to(FP8), scale
    bn, bk = block
    qs, ss = [], []
    for half in w.chunk(halves, dim=1):
        e, n, k = half.shape
        rows, cols = -(-n // bn), -(-k // bk)
        padded = torch.nn.functional.pad(half, (0, cols * bk - k, 0, rows * bn - n))
        tiles = padded.view(e, rows, bn, cols, bk)
        scale = (tiles.abs().amax(dim=(2, 4)) / quant_reference.FP8_MAX).clamp(min=1e-12)
        q = (tiles / scale[:, :, None, :, None]).view(e, rows * bn, cols * bk)[:, :n, :k]
        qs.append(q.to(FP8))
        ss.append(scale)
    return torch.cat(qs, dim=1), torch.cat(ss, dim=1)


def _case(num_tokens: int, num_experts: int, hidden: int, inter: int, device: torch.device):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter**0.5
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    logits[:, :3] += 3.0  # skewed: some experts get no token
    weights, ids = reference.moe_route(logits, 2, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("num_tokens", "block"), [(1, None), (9, None), (1, (16, 32)), (21, (16, 32))]
)
def test_fused_moe_fp8_matches_reference(
    device: torch.device, num_tokens: int, block: tuple[int, int] | None
) -> None:
    """8 experts top-2, intermediate 24 (not a multiple of the tiles or the block rows)."""
    num_experts, hidden, inter = 8, 64, 24
    x, w13, w2, weights, ids = _case(num_tokens, num_experts, hidden, inter, device)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)
    assert (counts == 0).any() and (num_tokens > 1 or (counts == 1).sum() == 2)
    w13_q, w13_s = quantize_experts(w13, block, 2)
    w2_q, w2_s = quantize_experts(w2, block, 1)
    out = moe.fused_moe(
        x, w13_q, w2_q, weights, ids, config=SMALL, w13_scale=w13_s, w2_scale=w2_s, block=block
    )
    ref = quant_reference.fused_moe_fp8(x, w13_q, w13_s, w2_q, w2_s, block, weights, ids)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2  # bf16 rounding of the activations and the output
    # The FP8 model stays near the unquantized one (e4m3 has a 3-bit mantissa).
    exact = reference.fused_moe(x.float(), w13, w2, weights, ids)
    assert rel_err(ref.float(), exact) < 0.1


def test_fused_moe_fp8_expert_parallel(device: torch.device) -> None:
    """Two ranks with alternate experts: each partial sum equals the reference's."""
    num_experts, hidden, inter = 4, 64, 32
    x, w13, w2, weights, ids = _case(6, num_experts, hidden, inter, device)
    w13_q, w13_s = quantize_experts(w13, None, 2)
    w2_q, w2_s = quantize_experts(w2, None, 1)
    for rank in range(2):
        local = torch.arange(rank, num_experts, 2, device=device)
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        expert_map[local] = torch.arange(local.numel(), dtype=torch.int32, device=device)
        args = (w13_q[local], w13_s[local], w2_q[local], w2_s[local])
        part = moe.fused_moe(
            x, args[0], args[2], weights, ids, expert_map, SMALL, args[1], args[3], None
        )
        ref = quant_reference.fused_moe_fp8(
            x, args[0], args[1], args[2], args[3], None, weights, ids, expert_map
        )
        assert rel_err(part, ref) < 2e-2
