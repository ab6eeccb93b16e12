"""silu_and_mul and gelu_tanh_and_mul (Triton) equal their references."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402

ACTIVATIONS = {
    "silu": (silu_and_mul, reference.silu_and_mul),
    "gelu_tanh": (gelu_tanh_and_mul, reference.gelu_tanh_and_mul),
}


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (7, 2 * 96)),
        (torch.bfloat16, (3, 4, 2 * 64)),  # leading dims flattened
        (torch.float16, (5, 2 * 1500)),  # two column blocks, masked tail
    ],
)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_act_and_mul(
    device: torch.device, act: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    kernel, ref_fn = ACTIVATIONS[act]
    gen = torch.Generator().manual_seed(shape[-1])
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    x[..., :3] = torch.tensor([-30.0, 0.0, 30.0])  # saturated and zero gates
    out = kernel(x)
    ref = ref_fn(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # Two roundings to x's dtype (the activation, then the product): one unit each at most.
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_act_and_mul_rejects_odd_width(device: torch.device, act: str) -> None:
    with pytest.raises(ValueError, match="not even"):
        ACTIVATIONS[act][0](torch.zeros((2, 5), device=device))
