"""rotary_embedding (Triton) equals reference.rotary_embedding."""

from __future__ import annotations

import pytest
import torch

from asyncserve.kernels import reference

pytest.importorskip("triton", reason="triton is not installed")

from asyncserve.kernels.rope import rotary_embedding  # noqa: E402


def _cos_sin_cache(max_pos: int, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "rotary_dim"),
    [
        (torch.float32, 64, 64),
        (torch.bfloat16, 32, 32),
        (torch.float32, 64, 32),  # partial rotary: dims past 32 stay as they are
        (torch.float16, 48, 48),  # half 24: not a power of 2
    ],
)
def test_rotary_embedding(
    device: torch.device, dtype: torch.dtype, head_dim: int, rotary_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_tokens, num_heads, num_kv_heads = 11, 4, 2
    cache = _cos_sin_cache(128, rotary_dim).to(device)
    positions = torch.randint(0, 128, (num_tokens,), generator=gen).to(device)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen).to(dtype).to(device)
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen).to(dtype).to(device)
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    out_q, out_k = rotary_embedding(positions, query.clone(), key.clone(), cache)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out_q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(out_k, ref_k, atol=tol, rtol=tol)


def test_rotary_in_place_on_fused_qkv(device: torch.device) -> None:
    """Query and key as views of one qkv tensor are rotated in place and returned."""
    gen = torch.Generator().manual_seed(9)
    cache = _cos_sin_cache(64, 32).to(device)
    qkv = torch.randn((5, 8, 32), generator=gen).to(device)
    positions = torch.tensor([0, 3, 63, 7, 7], device=device)
    query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:8]
    value_before = value.clone()
    ref_q, ref_k = reference.rotary_embedding(positions, query, key, cache)
    out_q, out_k = rotary_embedding(positions, query, key, cache)
    assert out_q.data_ptr() == query.data_ptr() and out_k.data_ptr() == key.data_ptr()
    torch.testing.assert_close(qkv[:, :4], ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 4:6], ref_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 6:8], value_before)
