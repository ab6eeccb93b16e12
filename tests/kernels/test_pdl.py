"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run; on a Hopper GPU a
decode chain of PDL kernels (norm, int4 GEMV with its split-K sum, activation, FP8
quantization and GEMV) captured in a CUDA graph gives, replay after replay on fresh inputs,
the same bits as the chain launched without PDL: every kernel waits for its predecessor's
writes before reading them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import quant_reference as reference  # noqa: E402
from asyncserve.kernels.activation import silu_and_mul  # noqa: E402
from asyncserve.kernels.fp8_gemm import per_token_group_quant_fp8  # noqa: E402
from asyncserve.kernels.fp8_gemv import fp8_gemv  # noqa: E402
from asyncserve.kernels.int4_gemv import int4_gemv  # noqa: E402
from asyncserve.kernels.norm import fused_add_rms_norm  # noqa: E402
from asyncserve.kernels.pdl import pdl_enabled, pdl_launch  # noqa: E402
from asyncserve.quantization.fp8 import quantize_fp8_per_channel  # noqa: E402


def test_pdl_is_off_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl_enabled(torch.device("cpu"))
    assert pdl_launch(False) == {}
    assert pdl_launch(True) == {"launch_pdl": True}
    monkeypatch.setenv("ASYNCSERVE_PDL", "0")
    assert not pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("ASYNCSERVE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))


_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _chain(
    x: torch.Tensor, residual: torch.Tensor, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """A decode layer's MLP half at one token: add + norm, int4 gate_up (split K), SiLU and
    multiply, FP8 down (quantize, GEMV)."""
    normed, summed = fused_add_rms_norm(x, residual, params["norm"], 1e-6)
    gate_up = int4_gemv(normed, params["qweight"], params["scales"], params["zeros"], None, 128)
    act = silu_and_mul(gate_up)
    act_q, act_scale = per_token_group_quant_fp8(act, act.shape[1])
    return fp8_gemv(act_q, params["w_q"], act_scale, params["w_scale"], x.dtype) + summed


@pytest.mark.skipif(not _HOPPER, reason="PDL needs a CUDA GPU of sm_90 or later")
def test_graph_of_pdl_kernels_equals_the_chain_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = torch.device("cuda")
    hidden, inter, group = 1024, 2048, 128
    g = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (2 * inter, hidden), generator=g)
    w = torch.randn(hidden, inter, generator=g) * 0.05
    w_q, w_scale = quantize_fp8_per_channel(w)
    params = {
        "norm": torch.rand(hidden, generator=g).to(device, torch.bfloat16) + 0.5,
        "qweight": reference.pack_int4(values).to(device),
        "scales": (torch.rand(2 * inter, hidden // group, generator=g) * 0.02 + 0.001).to(
            device, torch.bfloat16
        ),
        "zeros": torch.randint(0, 16, (2 * inter, hidden // group), generator=g).to(
            device, torch.bfloat16
        ),
        "w_q": w_q.to(device),
        "w_scale": w_scale.to(device),
    }
    inputs = [
        (torch.randn(1, hidden, generator=g), torch.randn(1, hidden, generator=g)) for _ in range(4)
    ]
    monkeypatch.setenv("ASYNCSERVE_PDL", "0")
    expected = [
        _chain(x.to(device, torch.bfloat16), r.to(device, torch.bfloat16), params)
        for x, r in inputs
    ]
    monkeypatch.setenv("ASYNCSERVE_PDL", "1")
    assert pdl_enabled(device)
    static_x = torch.zeros(1, hidden, device=device, dtype=torch.bfloat16)
    static_r = torch.zeros_like(static_x)
    _chain(static_x, static_r, params)  # compiles the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _chain(static_x, static_r, params)
    for (x, r), want in zip(inputs, expected, strict=True):
        static_x.copy_(x.to(torch.bfloat16))
        static_r.copy_(r.to(torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(static_out, want, rtol=0, atol=0)
