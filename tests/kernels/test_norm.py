"""rms_norm, fused_add_rms_norm and add_parts_rms_norm (Triton) equal their references."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.norm import (  # noqa: E402
    add_parts_rms_norm,
    fused_add_rms_norm,
    rms_norm,
)
from asyncserve.kernels.split_k import sum_splits  # noqa: E402

# fp32 statistics summed in another order: fp32 agrees to rounding; bf16 / fp16 outputs
# may differ by one unit in the last place where the fp32 value sits on a rounding edge
# (two roundings: the normalised row, then the product with the weight).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(out: torch.Tensor, ref: torch.Tensor, bf16_rtne: bool) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=TOL[ref.dtype], rtol=TOL[ref.dtype])
    # Nearly every element equal where the kernel rounds as torch does: only values on a
    # rounding edge may move.
    if ref.dtype == torch.float16 or (ref.dtype == torch.bfloat16 and bf16_rtne):
        assert (out != ref).float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of 2 (masked tail)
def test_rms_norm(device: torch.device, bf16_rtne: bool, dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn((2, 5, hidden), generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    _close(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), bf16_rtne)


def test_rms_norm_fp32_weight_promotes(device: torch.device, bf16_rtne: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((7, 64), generator=gen).to(torch.bfloat16).to(device)
    weight = torch.randn(64, generator=gen).to(device)
    out = rms_norm(x, weight, 1e-5)
    ref = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    tol = 1e-5 if bf16_rtne else 1e-2  # the normalised row is rounded to bf16 first
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm(device: torch.device, bf16_rtne: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((9, 80), generator=gen).to(dtype).to(device)
    residual = (5 * torch.randn((9, 80), generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(80, generator=gen)).to(dtype).to(device)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    if dtype == torch.float32 or bf16_rtne:
        assert torch.equal(summed, ref_summed)  # one rounding of the same sum
    else:
        torch.testing.assert_close(summed, ref_summed, atol=0, rtol=1e-2)
    _close(out, ref_out, bf16_rtne)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_strided_rows(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn((6, 128), generator=gen).to(device)
    x = wide[:, :64]  # row stride 128
    weight = torch.randn(64, generator=gen).to(device)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5
    )


def test_rms_norm_per_head_view_of_fused_rows(device: torch.device) -> None:
    """Per-head norms on the query slice of fused qkv rows: [tokens, heads, head_dim] with
    the rows' stride, normalised in place of a copy."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn((5, 4 * 32 + 2 * 2 * 32), generator=gen).to(device)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    assert not q.is_contiguous()
    weight = torch.randn(32, generator=gen).to(device)
    out = rms_norm(q, weight, 1e-6)
    assert out.shape == (5, 4, 32) and out.is_contiguous()
    torch.testing.assert_close(out, reference.rms_norm(q, weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_parts", [1, 3])
def test_add_parts_rms_norm_equals_split_sum_then_fused_add(
    device: torch.device, bf16_rtne: bool, dtype: torch.dtype, num_parts: int
) -> None:
    """A split-K projection's fp32 parts added inside the norm give the same outputs as
    split_k.sum_splits' sum followed by fused_add_rms_norm (the path they replace)."""
    gen = torch.Generator().manual_seed(num_parts)
    parts = torch.randn((num_parts, 3, 96), generator=gen).to(device)
    residual = (5 * torch.randn((3, 96), generator=gen)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype).to(device)
    summed_x = torch.empty((3, 96), dtype=dtype, device=device)
    sum_splits(parts, summed_x)
    want_out, want_summed = fused_add_rms_norm(summed_x, residual, weight, 1e-6)
    out, summed = add_parts_rms_norm(parts, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed) and torch.equal(out, want_out)
    ref_out, ref_summed = reference.add_parts_rms_norm(parts, residual, weight, 1e-6)
    if dtype == torch.float32 or bf16_rtne:
        assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(summed, ref_summed, atol=TOL[dtype], rtol=TOL[dtype])
    _close(out, ref_out, bf16_rtne)


def test_add_parts_rms_norm_checks_its_parts(device: torch.device) -> None:
    residual = torch.zeros((2, 64), device=device)
    weight = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="partial sums"):
        add_parts_rms_norm(torch.zeros((2, 3, 64), device=device), residual, weight, 1e-6)
    with pytest.raises(ValueError, match="partial sums"):
        add_parts_rms_norm(torch.zeros((2, 2, 64), device=device).half(), residual, weight, 1e-6)
