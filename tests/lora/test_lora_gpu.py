"""LoRA on the GPU: the Triton shrink / expand inside the decode CUDA graphs, with a mixed
batch of adapters (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from asyncserve import LoRARequest, SamplingParams
from asyncserve.llm import LLM
from tests.lora.conftest import TinyLoRA, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NUM_TOKENS = 16


def _prefix_match(a: list[int], b: list[int]) -> int:
    """Positions equal up to the first divergence (after it the texts differ anyway)."""
    n = 0
    for x, y in zip(a, b, strict=True):
        if x != y:
            break
        n += 1
    return n


def test_gpu_mixed_adapters_with_cuda_graphs(tiny_lora: TinyLoRA) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (6, 21, 40, 11)]
    loras: list[LoRARequest | None] = [None] + [
        LoRARequest(f"ad{i}", i + 1, str(a.path)) for i, a in enumerate(tiny_lora.adapters)
    ]
    llm = LLM(str(tiny_lora.base_path), device="cuda", dtype="float32", enable_lora=True,
              max_loras=3, max_lora_rank=16, gpu_memory_utilization=0.3)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        mixed_prompts = [p for p in prompts for _ in loras]
        mixed_loras = [lora for _ in prompts for lora in loras]
        outputs = llm.generate(mixed_prompts, params, use_tqdm=False, lora_request=mixed_loras)
        runner = llm.engine.runner
        assert runner is not None and runner.decode_graphs is not None
        assert runner.decode_graphs.graphs  # decode steps replayed graphs
    finally:
        llm.close()
    matched = 0
    models = [tiny_lora.base] + [a.model for a in tiny_lora.adapters]
    for i, output in enumerate(outputs):
        prompt = mixed_prompts[i]
        expected = hf_greedy(models[i % len(loras)], prompt, NUM_TOKENS)
        matched += _prefix_match(output.outputs[0].token_ids, expected)
    rate = matched / (NUM_TOKENS * len(outputs))
    print(f"GPU LoRA vs transformers + peft (fp32) greedy prefix match: {rate:.3f}")
    assert rate >= 0.9
