"""`--quantization fp8` on an unquantized checkpoint: weights quantized at load (per channel),
activations per token; on CPU the dequantizing reference path runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve.kernels.quant_reference import FP8_DTYPE
from asyncserve.llm import LLM
from asyncserve.outputs import RequestOutput
from asyncserve.quantization.fp8 import quantize_fp8_per_channel
from tests.quantization.conftest import greedy_agreement

# Measured: 235 of 256 positions (91.8%) on SmolLM2-135M in fp32, with 1 and 2 threads (227
# when this test was written, on an older tree). benchmarks/fp8_agreement.py takes it apart:
# weights alone 234, activations alone 244, and scales raised by up to 10% at random (as
# accurate, rounded elsewhere) 228..240 over eight draws: the measure moves by several
# points between equally accurate roundings (the model has many near-tied top tokens).
# The bound: 90% of positions.
MIN_AGREEMENT = 0.90


@pytest.fixture(scope="module")
def fp8_llm(gguf_path: Path):  # type: ignore[no-untyped-def]
    llm = LLM(str(gguf_path), device="cpu", max_model_len=256, kv_cache_memory=16 << 20,
              quantization="fp8")  # fmt: skip
    yield llm
    llm.close()


def test_per_channel_quantization_round_trip() -> None:
    w = torch.randn(64, 128) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (64, 1)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values.
    err = (q.float() * scale - w).abs()
    assert (err <= w.abs() * 2**-4 + scale * 2**-9).all()
    assert q.float().abs().amax(dim=1).eq(448).all()  # each row uses the whole range


def test_linear_layers_hold_fp8(fp8_llm: LLM) -> None:
    model = fp8_llm.engine.loaded.model
    params = dict(model.named_parameters())
    for name in ("qkv_proj", "o_proj"):
        assert params[f"model.layers.0.self_attn.{name}.weight"].dtype == FP8_DTYPE
    for name in ("gate_up_proj", "down_proj"):
        assert params[f"model.layers.3.mlp.{name}.weight"].dtype == FP8_DTYPE
    assert params["model.layers.0.mlp.down_proj.weight_scale"].shape == (576, 1)
    assert params["model.embed_tokens.weight"].dtype == torch.float32  # embeddings stay


def test_greedy_agreement_with_unquantized(
    fp8_llm: LLM, greedy_reference: list[RequestOutput]
) -> None:
    """8 prompts x 32 greedy tokens of the unquantized model; at each position, the fp8
    model given the same prefix ranks the same token first."""
    agree, total = greedy_agreement(fp8_llm, greedy_reference)
    assert total == 8 * 32
    assert agree / total >= MIN_AGREEMENT, f"{agree}/{total} positions agree"
