"""int4 decode steps with fewer kernels, each giving the values of the path it replaces: a
gated MLP's gate_up GEMV applies the activation to its own sums (on CUDA, up to the GEMV's
tokens, no bias; elsewhere the activation kernel runs), and o_proj's and down_proj's split-K
partial sums go to the next fused add-norm unsummed (models/split_sums.py)."""

from __future__ import annotations

import pytest
import torch

from asyncserve.config import ModelConfig
from asyncserve.kernels.ops import select_ops
from asyncserve.models.layers import GatedMLP, Linear, RMSNorm
from asyncserve.models.llama import LlamaDecoderLayer
from asyncserve.models.loader import load_model
from asyncserve.models.split_sums import SplitSums, dense
from asyncserve.quantization.int4 import GPTQLinearMethod, Int4LinearMethod
from tests.models.conftest import full_forward
from tests.quantization.test_fp8_checkpoints import FIXTURES, IDS

HIDDEN, INTERMEDIATE, GROUP = 64, 128, 32
CPU = torch.device("cpu")
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


def _split_output(model: torch.nn.Module, on: bool) -> list[LlamaDecoderLayer]:
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    for layer in layers:
        layer.self_attn.split_output = on
        assert isinstance(layer.mlp, GatedMLP)
        layer.mlp.split_output = on
    return layers


def test_llama_layers_leave_split_sums_and_cpu_runs_dense() -> None:
    """The model's layers ask for split sums; on CPU (no GEMV) the projections answer with
    plain tensors, and the logits equal those of layers that do not ask."""
    loaded = load_model(ModelConfig(model=str(FIXTURES / "llama-w4a16"), dtype="float32"), CPU)
    layers = _split_output(loaded.model, True)
    assert layers and all(layer.self_attn.split_output for layer in layers)
    with_flags = full_forward(loaded.model, IDS)
    _split_output(loaded.model, False)
    torch.testing.assert_close(full_forward(loaded.model, IDS), with_flags, rtol=0, atol=0)


def test_norm_adds_split_sums_on_cpu() -> None:
    norm = RMSNorm(8, 1e-6, select_ops(CPU))
    norm.weight.data = torch.linspace(0.5, 1.5, 8)
    parts = torch.randn(3, 2, 8)
    residual = torch.randn(2, 8)
    out, summed = norm(SplitSums(parts, torch.float32), residual)
    want_out, want_summed = norm(dense(SplitSums(parts, torch.float32)), residual)
    assert torch.equal(out, want_out) and torch.equal(summed, want_summed)


@CUDA
@pytest.mark.parametrize("tokens", [1, 3, 9])  # split sums to 4 tokens (the GEMV); past, dense
def test_cuda_split_sums_give_the_same_logits(tokens: int) -> None:
    config = ModelConfig(model=str(FIXTURES / "llama-w4a16"), dtype="bfloat16")
    model = load_model(config, torch.device("cuda")).model
    ids = (IDS * 4)[:tokens]
    _split_output(model, False)
    dense_logits = full_forward(model, ids)
    layers = _split_output(model, True)
    mlp = layers[0].mlp
    x = torch.randn(tokens, mlp.gate_up_proj.in_features, device="cuda", dtype=torch.bfloat16)
    assert isinstance(mlp(x), SplitSums) == (tokens <= 4)
    torch.testing.assert_close(full_forward(model, ids), dense_logits, rtol=0, atol=0)
