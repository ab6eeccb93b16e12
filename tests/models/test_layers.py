"""Layers: rotary tables equal HF's for every supported scaling; norms, MLP, linear."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from asyncserve.kernels.ops import REFERENCE_OPS
from asyncserve.models.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    compute_cos_sin_cache,
    compute_logits,
)

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("theta", "scaling"),
    [(10000.0, None), (5e5, LLAMA3), (1e4, {"rope_type": "linear", "factor": 4.0})],
)
def test_cos_sin_cache_matches_hf(theta: float, scaling: dict[str, Any] | None) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, max_pos = 32, 512
    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    positions = torch.arange(max_pos)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cache = compute_cos_sin_cache(head_dim, max_pos, theta, scaling, torch.float32)
    assert cache.shape == (max_pos, head_dim)
    half = head_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], atol=1e-6, rtol=0)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain = compute_cos_sin_cache(64, 128, 5e5, None)
    scaled = compute_cos_sin_cache(64, 128, 5e5, LLAMA3)
    # The highest frequency (pair 0) is kept; the lowest (pair 31) is slowed by the factor,
    # which for such small angles divides its sine by 8.
    torch.testing.assert_close(scaled[:, [0, 32]], plain[:, [0, 32]])
    torch.testing.assert_close(scaled[:, 63], plain[:, 63] / 8, rtol=1e-3, atol=0)


def test_cos_sin_cache_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        compute_cos_sin_cache(63, 16, 1e4, None)
    with pytest.raises(ValueError, match="rope_scaling"):
        compute_cos_sin_cache(64, 16, 1e4, {"rope_type": "yarn", "factor": 2.0})


def test_rotary_embedding_rotates_pairs_by_position() -> None:
    rope = RotaryEmbedding(8, 32, 10000.0, None, REFERENCE_OPS)
    q = torch.randn(3, 2, 8)
    k = torch.randn(3, 1, 8)
    positions = torch.tensor([0, 5, 31])
    q_out, k_out = rope(positions, q, k)
    # Position 0 is the identity; rotation preserves each (i, i + 4) pair's norm.
    torch.testing.assert_close(q_out[0], q[0])
    pair_norm = (q[..., :4] ** 2 + q[..., 4:] ** 2).sqrt()
    torch.testing.assert_close((q_out[..., :4] ** 2 + q_out[..., 4:] ** 2).sqrt(), pair_norm)
    assert k_out.shape == k.shape


def test_rms_norm_with_and_without_residual() -> None:
    norm = RMSNorm(16, 1e-6, REFERENCE_OPS)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x, r = torch.randn(4, 16), torch.randn(4, 16)

    def expected(v: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight

    torch.testing.assert_close(norm(x), expected(x))
    out, new_residual = norm(x, r)
    torch.testing.assert_close(new_residual, x + r)
    torch.testing.assert_close(out, expected(x + r))


def test_gated_mlp_fuses_gate_and_up() -> None:
    mlp = GatedMLP(8, 12, REFERENCE_OPS)
    gate, up, down = torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.cat([gate, up]))
        mlp.down_proj.weight.copy_(down)
    x = torch.randn(5, 8)
    expected = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(mlp(x), expected)


def test_linear_is_created_on_the_default_device_and_dtype() -> None:
    with torch.device("meta"):
        layer = Linear(4, 6, bias=True)
    assert layer.weight.device.type == "meta"
    assert layer.weight.shape == (6, 4)
    assert layer.bias is not None and layer.bias.shape == (6,)
    assert not layer.weight.requires_grad


def test_longrope_table_matches_hf_short_then_long() -> None:
    """Phi-3 LongRoPE with a partial rotary: positions inside the original context equal
    HF's short-factor table, positions past it HF's long-factor one, both scaled by HF's
    attention factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from asyncserve.models.arch_config import ArchConfig

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 6.0, 9.0],
    }
    hf_config = transformers.Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_parameters=rope,
    )
    ours = ArchConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert ours.rotary_dim == 8 and ours.rope_scaling is not None
    cache = compute_cos_sin_cache(8, 128, ours.rope_theta, ours.rope_scaling)
    hf_rope = Phi3RotaryEmbedding(hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    cos_short, _ = hf_rope(x, torch.arange(32)[None])  # seq_len 32: short factors
    cos_long, sin_long = hf_rope(x, torch.arange(128)[None])  # past 32: long factors
    torch.testing.assert_close(cache[:32, :4], cos_short[0, :, :4], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[32:, :4], cos_long[0, 32:, :4], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[32:, 4:], sin_long[0, 32:, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(cache[:32, :4], cos_long[0, :32, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_logits_is_fp32_of_the_head_product(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 32, generator=gen).to(dtype)
    head = torch.randn(100, 32, generator=gen).to(dtype)
    logits = compute_logits(hidden, head)
    assert logits.dtype == torch.float32 and logits.shape == (5, 100)
    torch.testing.assert_close(logits, F.linear(hidden, head).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_logits_on_cuda_writes_fp32_sums(dtype: torch.dtype) -> None:
    """The GEMM's own fp32 output: within the 16-bit rounding of the old path, and closer
    to the fp32 product than that rounding."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 256, generator=gen).to(dtype).cuda()
    head = torch.randn(1000, 256, generator=gen).to(dtype).cuda()
    logits = compute_logits(hidden, head)
    exact = hidden.float() @ head.float().t()
    rounded = F.linear(hidden, head).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, rounded, atol=0.25, rtol=1e-2)
    assert (logits - exact).abs().mean() < (rounded - exact).abs().mean()
