"""FP8 kernels (Triton) equal their references: per-token-group activation quantization and
the block-scaled FP8 GEMM, including one-token (decode) and ragged shapes."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import quant_reference as reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.fp8_gemm import (  # noqa: E402
    per_token_group_quant_fp8,
    w8a8_block_fp8_matmul,
)


@pytest.mark.parametrize(("m", "k", "group"), [(1, 256, 128), (5, 192, 64), (3, 96, 96)])
def test_group_quant_matches_reference(device: torch.device, m: int, k: int, group: int) -> None:
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10).to(device)
    x[0, :group] = 0.0  # an all-zero group quantizes to zeros, not NaN
    q, s = per_token_group_quant_fp8(x, group)
    q_ref, s_ref = reference.per_token_group_quant_fp8(x, group)
    assert q.dtype == reference.FP8_DTYPE and s.shape == (m, -(-k // group))
    torch.testing.assert_close(s, s_ref)
    got, want = q.float(), q_ref.float()
    if device.type == "cuda":
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    # Triton's interpreter drops the carry when a value rounds up into the next binade
    # (125.6 -> 64 instead of 128); every other element must be exact.
    wrong = got != want
    carry = (want.abs().log2() == want.abs().log2().round()) & (got == want / 2)
    assert (carry | ~wrong).all(), (got[wrong & ~carry], want[wrong & ~carry])


@pytest.mark.parametrize(
    ("m", "n", "k", "block"),
    [
        (1, 256, 256, (128, 128)),  # one token: the decode shape
        (7, 320, 384, (128, 128)),  # N not a multiple of the block: a partial scale row
        (20, 96, 128, (32, 64)),  # smaller blocks, several k tiles per block row
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_fp8_matmul_matches_reference(
    device: torch.device,
    m: int,
    n: int,
    k: int,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=g).to(device)
    w_q = (torch.randn(n, k, generator=g) * 50).to(reference.FP8_DTYPE).to(device)
    w_s = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 1e-2).to(device)
    x_q, x_s = reference.per_token_group_quant_fp8(x, block[1])
    out = w8a8_block_fp8_matmul(x_q, w_q, x_s, w_s, block, out_dtype)
    ref = reference.w8a8_block_fp8_matmul(x_q, w_q, x_s, w_s, block, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    tol = 1e-4 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_block_fp8_matmul_of_no_tokens(device: torch.device) -> None:
    x_q = torch.empty(0, 128, device=device).to(reference.FP8_DTYPE)
    w_q = torch.zeros(128, 128, device=device).to(reference.FP8_DTYPE)
    scales = torch.ones(1, 1, device=device)
    out = w8a8_block_fp8_matmul(x_q, w_q, scales[:0], scales, (128, 128), torch.float32)
    assert out.shape == (0, 128)
