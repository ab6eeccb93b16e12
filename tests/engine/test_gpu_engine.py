"""End to end on the GPU: SmolLM2 in bf16 with the Triton kernels and CUDA graphs against
the CPU fp32 reference path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from tests.conftest import PLAIN_PROMPTS
from tests.engine.test_gpu_agreement import prefix_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_TOKENS = 32


def test_bf16_gpu_greedy_matches_cpu_fp32(gguf_path) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    gpu = LLM(model=str(gguf_path), device="cuda", dtype="bfloat16")
    gpu_out = [o.outputs[0].token_ids for o in gpu.generate(PLAIN_PROMPTS, params, use_tqdm=False)]
    assert gpu.engine.num_free_blocks == gpu.engine.num_total_blocks
    gpu.close()
    cpu = LLM(model=str(gguf_path), device="cpu", dtype="float32")
    cpu_out = [o.outputs[0].token_ids for o in cpu.generate(PLAIN_PROMPTS, params, use_tqdm=False)]
    rate = prefix_agreement(gpu_out, cpu_out)
    print(f"bf16 GPU vs fp32 CPU greedy match rate (prefix): {rate:.3f}")
    assert rate >= 0.5
