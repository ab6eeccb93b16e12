"""GGUF Q8_0 / Q4_1 / Q4_K blocks repacked and multiplied: the repacked weights against
gguf.quants' own dequantizers, and the Triton kernel (interpreter) against the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from asyncserve.kernels import quant_reference as reference
from asyncserve.quantization.gguf import BLOCKS, repack

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.gguf_gemm import GEMV_MAX_TOKENS, gguf_matmul  # noqa: E402


def gguf_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes] of a random [n, k] weight in `qtype`: quantized by gguf.quants
    where it can (Q8_0, Q4_1); Q4_K (which gguf.quants cannot quantize) as random blocks with
    small finite fp16 scales and random 6-bit scale bytes and nibbles."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q8_0, T.Q4_1):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return gguf.quants.quantize(w, qtype)
    block, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    d = (rng.random((n, k // block, 2)) * 0.01).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(n, k // block, 4)
    return raw.reshape(n, -1)


def gguf_dequant(raw: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def _layout_args(raw: np.ndarray, qtype: T, k: int) -> tuple:
    lay = repack(torch.from_numpy(raw), qtype, k)
    return (lay.qweight, lay.scale, lay.minimum, lay.sub_scale, lay.sub_min, lay.super_block)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K])
def test_repacked_weights_equal_gguf_dequantize(qtype: T) -> None:
    n, k = 24, 512
    raw = gguf_blocks(qtype, n, k)
    ours = reference.dequant_gguf(*_layout_args(raw, qtype, k))
    expected = gguf_dequant(raw, qtype)
    assert expected.shape == (n, k)
    # The same fp32 operations in the same order: bit-identical.
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_q4_1_repack_is_compact() -> None:
    lay = repack(torch.from_numpy(gguf_blocks(T.Q4_1, 8, 256)), T.Q4_1, 256)
    assert lay.qweight.dtype == torch.int32 and lay.qweight.shape == (8, 32)
    assert lay.scale.dtype == torch.float16 and lay.scale.shape == (8, 8)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K])
@pytest.mark.parametrize("m", [1, GEMV_MAX_TOKENS, 5, 33])  # GEMV, then GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gguf_gemm_matches_reference(
    device: torch.device, qtype: T, m: int, dtype: torch.dtype
) -> None:
    n, k = 40, 256 if qtype == T.Q4_K else 96  # n not a tile multiple; k = 3 blocks of 32
    raw = gguf_blocks(qtype, n, k, seed=m)
    args = _layout_args(raw, qtype, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    on_device = (a.to(device) if torch.is_tensor(a) else a for a in args)
    out = gguf_matmul(x.to(device), *on_device).cpu()
    assert out.dtype == dtype
    expected = reference.gguf_matmul(x, *args)
    if dtype != torch.float32 and m > GEMV_MAX_TOKENS and device.type == "cuda":
        # Compiled, the GEMM path feeds tensor cores a dequantized tile rounded to x's dtype.
        w16 = gguf_dequant(raw, qtype).to(dtype).float()
        expected = (x.float() @ w16.t()).to(dtype)
    # fp32 sums in another order; bf16: one unit in the last place (8 bits) of the result.
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    # And against gguf's own dequantized weight (rounded as the GEMM path rounds it).
    w = gguf_dequant(raw, qtype)
    if dtype != torch.float32 and m > GEMV_MAX_TOKENS and device.type == "cuda":
        w = w.to(dtype).float()
    torch.testing.assert_close(
        out.float(), (x.float() @ w.t()).to(dtype).float(), rtol=tol, atol=tol
    )
