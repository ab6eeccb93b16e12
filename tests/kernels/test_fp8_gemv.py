"""The FP8 GEMV (decode) equals quant_reference.fp8_rowwise_matmul: one to four tokens, N
not a multiple of the output block, K of one step and not a multiple of it, the split-K
reduction (even and ragged splits), bias, bf16 / fp16 / fp32 activations, a token of zeros
(the scale floor), a per-tensor weight scale; and the W8A8 layer's CUDA route
(quantization/fp8._rowwise_scaled_mm) takes it for a few tokens. Under Triton's interpreter on
CPU, so the shapes are tiny."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import quant_reference as reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels import fp8_gemv as fp8_gemv_module  # noqa: E402
from asyncserve.kernels.fp8_gemv import (  # noqa: E402
    FP8_GEMV_MAX_TOKENS,
    fp8_gemv,
    fp8_gemv_config,
)
from asyncserve.kernels.split_k import GEMV_MAX_TOKENS, GemvConfig  # noqa: E402
from asyncserve.quantization import fp8 as fp8_layer  # noqa: E402

FP8 = reference.FP8_DTYPE


def _weight(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 row scales [N, 1]) of a random weight, quantized per channel."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w_q, scale = fp8_layer.quantize_fp8_per_channel(torch.randn(n, k, generator=g))
    return w_q.to(device), scale.to(device)


def _x(m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(m * 7 + k)
    return (torch.randn(m, k, generator=g) * 3).to(device, dtype)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 sums in another order (scales applied after the sum): fp32 rounding apart;
    bf16 / fp16 outputs one rounding of the output dtype apart."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-4 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _run(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
) -> None:
    """Both forms of x: e4m3 with its per-token scales, and x itself (no scale)."""
    x_q, x_s = reference.per_token_group_quant_fp8(x, x.shape[1])
    out = fp8_gemv(x_q, w_q, x_s, w_s, x.dtype, bias, config)
    _check(out, reference.fp8_rowwise_matmul(x_q, w_q, x_s, w_s, x.dtype, bias))
    out = fp8_gemv(x, w_q, None, w_s, x.dtype, bias, config)
    _check(out, reference.fp8_weight_only_matmul(x, w_q, w_s, x.dtype, bias))


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_matches_reference(device: torch.device, m: int, dtype: torch.dtype) -> None:
    """N = 40 is not a multiple of the 16-output blocks; K of two steps in two splits; bias."""
    n, k = 40, 128
    w_q, w_s = _weight(n, k, device)
    bias = torch.linspace(-1, 1, n).to(device, dtype)
    config = GemvConfig(block_n=16, block_k=64, split_k=2)
    _run(_x(m, k, dtype, device), w_q, w_s, bias, config)


@pytest.mark.parametrize(
    ("k", "block_k", "split_k"),
    [
        (64, 64, 1),  # K of one step
        (96, 64, 1),  # K not a multiple of the step (ragged tail)
        (192, 32, 3),  # three splits of two steps
        (160, 32, 2),  # five steps in splits of three: the last one short
        (40, 16, 2),  # K not a multiple of 16 (torch._scaled_mm refuses it)
    ],
)
@pytest.mark.parametrize("num_stages", [1, 3])  # 3: the loop's loads pipelined (GPU)
def test_gemv_steps_and_splits(
    device: torch.device, k: int, block_k: int, split_k: int, num_stages: int
) -> None:
    w_q, w_s = _weight(24, k, device)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(k)).to(device)
    for m in (1, 3):
        config = GemvConfig(16, block_k, split_k, num_stages=num_stages)
        _run(_x(m, k, torch.float32, device), w_q, w_s, bias if m == 3 else None, config)


def test_gemv_token_of_zeros_and_per_tensor_scale(device: torch.device) -> None:
    """A token of zeros gets the floor scale (zeros, not NaN: its output is the bias); one
    weight scale for all rows broadcasts, given as [1, 1] or as a 0-d tensor."""
    n, k = 24, 96
    w_q, _ = _weight(n, k, device)
    x = _x(3, k, torch.bfloat16, device)
    x[1] = 0.0
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(device, x.dtype)
    x_q, x_s = reference.per_token_group_quant_fp8(x, k)
    assert x_s[1].item() == pytest.approx(reference.FP8_MIN_SCALE)
    for w_s in (torch.tensor([[0.0125]]), torch.tensor(0.0125)):
        w_s = w_s.to(device)
        out = fp8_gemv(x_q, w_q, x_s, w_s, x.dtype, bias, GemvConfig(16, 32, 2))
        ref = reference.fp8_rowwise_matmul(x_q, w_q, x_s, w_s.reshape(1, 1), x.dtype, bias)
        _check(out, ref)
        assert torch.equal(out[1], bias)


def test_gemv_default_config_and_no_tokens(device: torch.device) -> None:
    """The shape-picked launch (one split off the GPU), and an empty batch."""
    w_q, w_s = _weight(20, 48, device)
    _run(_x(2, 48, torch.float32, device), w_q, w_s, None, None)
    x_q = torch.zeros(0, 48, device=device).to(FP8)
    out = fp8_gemv(x_q, w_q, torch.ones(0, 1, device=device), w_s, torch.bfloat16)
    assert out.shape == (0, 20) and out.dtype == torch.bfloat16


def test_gemv_rejects_bad_input(device: torch.device) -> None:
    w_q, w_s = _weight(16, 32, device)
    x_q = torch.zeros(1, 32, device=device).to(FP8)
    x_s = torch.ones(1, 1, device=device)
    with pytest.raises(ValueError, match="does not multiply"):
        fp8_gemv(x_q[:, :16], w_q, x_s, w_s, torch.float32)
    with pytest.raises(ValueError, match="must be e4m3"):
        fp8_gemv(x_q, w_q.float(), x_s, w_s, torch.float32)
    with pytest.raises(ValueError, match="with a scale"):
        fp8_gemv(x_q.float(), w_q, x_s, w_s, torch.float32)
    with pytest.raises(ValueError, match="without a scale"):
        fp8_gemv(x_q, w_q, None, w_s, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_gemv(x_q, w_q, x_s, w_s[:3], torch.float32)
    with pytest.raises(ValueError, match="bias of 3"):
        fp8_gemv(x_q, w_q, x_s, w_s, torch.float32, torch.zeros(3, device=device))


def _exact_x(m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Activations whose per-token quantization is exact (e4m3 values times a power of two,
    each row's amax 448 of them): the interpreter's e4m3 rounding of the quant kernel can
    lose a carry (tests/kernels/test_fp8_gemm.py), which this keeps out of the comparison."""
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * 100).to(FP8).float()
    x[:, 0] = reference.FP8_MAX
    return (x * 2.0**-6).to(device, dtype)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (24, 40)])  # the second: no torch._scaled_mm
def test_layer_route_takes_the_gemv_for_one_token(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, n: int, k: int
) -> None:
    """_rowwise_scaled_mm (the CUDA route of Fp8ChannelLinearMethod and
    Fp8OnlineLinearMethod) runs the GEMV on the unquantized token, never torch._scaled_mm;
    per-channel and per-tensor scales."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("torch._scaled_mm called for a decode batch")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    _check_route(device, FP8_GEMV_MAX_TOKENS, n, k)


@pytest.mark.parametrize("m", [2, GEMV_MAX_TOKENS])
def test_layer_route_of_a_ragged_layer_takes_the_gemv_for_a_few_tokens(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, m: int
) -> None:
    """A layer torch._scaled_mm refuses (dims not multiples of 16): 2-4 tokens take the GEMV
    on quantized activations (not the slow reference product)."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the reference product ran for a few tokens")

    monkeypatch.setattr(reference, "fp8_rowwise_matmul", refuse)
    w_q, w_s = _weight(24, 40, device)
    x = _exact_x(m, 40, torch.bfloat16, device)
    x_q, x_s = reference.per_token_group_quant_fp8(x, 40)
    out = fp8_layer._rowwise_scaled_mm(x, w_q, w_s, None)
    monkeypatch.undo()
    _check(out, reference.fp8_rowwise_matmul(x_q, w_q, x_s, w_s, x.dtype, None))


def test_layer_route_of_a_ragged_layer_takes_the_reference_past_the_gemv(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the GEMV's tokens, a ragged layer takes the reference product, not the GEMV."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the GEMV ran past its tokens")

    monkeypatch.setattr(fp8_gemv_module, "fp8_gemv", refuse)
    _check_route(device, GEMV_MAX_TOKENS + 1, 24, 40)


def _check_route(device: torch.device, m: int, n: int, k: int) -> None:
    w_q, w_s = _weight(n, k, device)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device, torch.bfloat16)
    x = _exact_x(m, k, torch.bfloat16, device)
    x_q, x_s = reference.per_token_group_quant_fp8(x, k)
    for scale in (w_s, torch.full_like(w_s, 0.02)):
        out = fp8_layer._rowwise_scaled_mm(x, w_q, scale, bias)
        if m <= FP8_GEMV_MAX_TOKENS:
            ref = reference.fp8_weight_only_matmul(x, w_q, scale, x.dtype, bias)
        else:
            ref = reference.fp8_rowwise_matmul(x_q, w_q, x_s, scale, x.dtype, bias)
        _check(out, ref)


def test_gemv_config_for_llama_3_8b() -> None:
    """Every layer of an 8B model gets at least 3 programs per SM of an H100 (132 SMs), in
    splits that divide K's steps evenly; a tiny K still loads 16 bytes at a time."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        config = fp8_gemv_config(n, k, 132)
        steps = k // config.block_k
        assert k % config.block_k == 0 and steps % config.split_k == 0
        assert -(-n // config.block_n) * config.split_k >= 3 * 132
    # One split each: the fastest in the H100 sweep on these shapes.
    assert all(fp8_gemv_config(n, k, 132).split_k == 1 for n, k in [(4096, 14336), (4096, 4096)])
    assert fp8_gemv_config(1024, 16384, 132).split_k == 4  # few rows, a long K: still split
    assert fp8_gemv_config(8, 8, 132).block_k == 16
    # The H100 sweep's tile: 512 columns a step, four steps of loads in flight.
    config = fp8_gemv_config(28672, 4096, 132)
    assert (config.block_n, config.block_k, config.num_stages) == (8, 512, 4)
