"""A gated MLP whose gate_up projection is int4: on CUDA a decode step's gate_up GEMV applies
the activation to its own sums (one kernel fewer a layer), with the same values as the GEMV
followed by the activation kernel; elsewhere, past the GEMV's tokens and under a bias, the
MLP runs the activation kernel."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels.ops import select_ops
from asyncserve.models.layers import GatedMLP, Linear
from asyncserve.quantization.int4 import GPTQLinearMethod, Int4LinearMethod

HIDDEN, INTERMEDIATE, GROUP = 64, 128, 32
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _int4(layer: Linear, seed: int, g_idx: torch.Tensor | None = None) -> None:
    """Random int4 weights in the layout apply() reads, on the layer's weight's device."""
    n, k = layer.out_features, layer.in_features
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // GROUP), generator=g).float()
    method = Int4LinearMethod(GROUP) if g_idx is None else GPTQLinearMethod(GROUP, True, False)
    method.set_layout(layer, values, scales, zeros, g_idx, ("weight",))
    layer.quant_method = method


def _mlp(device: torch.device, activation: str, g_idx: torch.Tensor | None = None) -> GatedMLP:
    with torch.device(device):
        mlp = GatedMLP(HIDDEN, INTERMEDIATE, select_ops(device), activation)
    _int4(mlp.gate_up_proj, 1, g_idx)
    _int4(mlp.down_proj, 2)
    return mlp.to(device)


def _unfused(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_and_mul(mlp.gate_up_proj(x)))


def _fused(mlp: GatedMLP, x: torch.Tensor, activation: str) -> torch.Tensor | None:
    method = mlp.gate_up_proj.quant_method
    assert method is not None
    return method.apply_act_and_mul(mlp.gate_up_proj, x, activation)


def test_cpu_takes_the_activation_kernel() -> None:
    mlp = _mlp(torch.device("cpu"), "silu")
    x = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    assert _fused(mlp, x, "silu") is None
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)


@CUDA
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens", [1, 4, 9])  # the gated GEMV to 4 tokens; a GEMM past
def test_cuda_decode_fuses_the_activation_into_the_gate_up_gemv(
    activation: str, tokens: int
) -> None:
    mlp = _mlp(torch.device("cuda"), activation)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)) * 4
    x = x.to("cuda", torch.bfloat16)
    fused = _fused(mlp, x, activation)
    assert (fused is None) == (tokens > 4)
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)


@CUDA
def test_cuda_act_order_gate_up_reads_x_permuted() -> None:
    """Its columns sorted by group, the layer reads x permuted, fused or not."""
    g_idx = torch.randperm(HIDDEN, generator=torch.Generator().manual_seed(3)) // GROUP
    mlp = _mlp(torch.device("cuda"), "silu", g_idx.int())
    assert mlp.gate_up_proj.w4_perm is not None
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert _fused(mlp, x, "silu") is not None
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)


@CUDA
def test_cuda_gate_up_with_a_bias_takes_the_activation_kernel() -> None:
    mlp = _mlp(torch.device("cuda"), "silu")
    mlp.gate_up_proj.bias = torch.nn.Parameter(torch.randn(2 * INTERMEDIATE, device="cuda"))
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert _fused(mlp, x, "silu") is None
