"""silu_and_mul (Triton) equals reference.silu_and_mul."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.activation import silu_and_mul  # noqa: E402


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (7, 2 * 96)),
        (torch.bfloat16, (3, 4, 2 * 64)),  # leading dims flattened
        (torch.float16, (5, 2 * 1500)),  # two column blocks, masked tail
    ],
)
def test_silu_and_mul(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(shape[-1])
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    out = silu_and_mul(x)
    ref = reference.silu_and_mul(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # Two roundings to x's dtype (silu, then the product): one unit each at most.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_silu_and_mul_rejects_odd_width(device: torch.device) -> None:
    with pytest.raises(ValueError, match="not even"):
        silu_and_mul(torch.zeros((2, 5), device=device))
