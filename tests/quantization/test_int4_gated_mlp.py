"""A gated MLP whose down projection is int4: on CUDA a decode step's down GEMV applies the
activation as it reads the gate_up output (one kernel fewer a layer), with the same bits as
the activation kernel followed by the GEMV; elsewhere, and for act-order layers that read x
permuted, the MLP runs the activation kernel first."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels.ops import select_ops
from asyncserve.models.layers import GatedMLP, Linear
from asyncserve.quantization.int4 import GPTQLinearMethod, Int4LinearMethod

HIDDEN, INTERMEDIATE, GROUP = 64, 128, 32


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
    _int4(mlp.gate_up_proj, 1)
    _int4(mlp.down_proj, 2, g_idx)
    return mlp.to(device)


def _unfused(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_and_mul(mlp.gate_up_proj(x)))


def test_cpu_takes_the_activation_kernel() -> None:
    mlp = _mlp(torch.device("cpu"), "silu")
    gate_up = torch.randn(1, 2 * INTERMEDIATE, dtype=torch.bfloat16)
    method = mlp.down_proj.quant_method
    assert method is not None and method.apply_gated(mlp.down_proj, gate_up, "silu") is None
    x = torch.randn(2, HIDDEN, dtype=torch.bfloat16)
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens", [1, 4, 9])  # the fused GEMV to 4 tokens; a GEMM past
def test_cuda_decode_fuses_the_activation_into_the_down_gemv(activation: str, tokens: int) -> None:
    mlp = _mlp(torch.device("cuda"), activation)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)) * 4
    x = x.to("cuda", torch.bfloat16)
    method = mlp.down_proj.quant_method
    assert method is not None
    fused = method.apply_gated(mlp.down_proj, mlp.gate_up_proj(x), activation)
    assert (fused is None) == (tokens > 4)
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_act_order_down_takes_the_activation_kernel() -> None:
    """Its columns sorted by group, the layer reads x permuted: the activation comes first."""
    g_idx = torch.randperm(INTERMEDIATE, generator=torch.Generator().manual_seed(3)) // GROUP
    mlp = _mlp(torch.device("cuda"), "silu", g_idx.int())
    assert mlp.down_proj.w4_perm is not None
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    method = mlp.down_proj.quant_method
    assert method is not None
    assert method.apply_gated(mlp.down_proj, mlp.gate_up_proj(x), "silu") is None
    torch.testing.assert_close(mlp(x), _unfused(mlp, x), rtol=0, atol=0)
