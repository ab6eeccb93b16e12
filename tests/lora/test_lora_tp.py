"""LoRA with tensor parallelism on CPU (gloo, 2 worker processes): each rank holds its share
of every adapter (A whole and B's rows for column-parallel q/k/v and gate/up, A's columns
for row-parallel o and down); a mixed batch equals transformers + peft token for token."""

from __future__ import annotations

import pytest
import torch

from asyncserve import LoRARequest, SamplingParams
from asyncserve.llm import LLM
from tests.lora.conftest import TinyLoRA, hf_greedy

pytestmark = pytest.mark.timeout(300)
NUM_TOKENS = 8


def test_tensor_parallel_mixed_adapters_match_peft(tiny_lora: TinyLoRA) -> None:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 23)]
    loras: list[LoRARequest | None] = [None] + [
        LoRARequest(f"ad{i}", i + 1, str(a.path)) for i, a in enumerate(tiny_lora.adapters)
    ]
    llm = LLM(str(tiny_lora.base_path), tensor_parallel_size=2, device="cpu", dtype="float32",
              block_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        mixed_prompts = [p for p in prompts for _ in loras]
        mixed_loras = [lora for _ in prompts for lora in loras]
        outputs = llm.generate(mixed_prompts, params, use_tqdm=False, lora_request=mixed_loras)
    finally:
        llm.close()
    models = [tiny_lora.base] + [a.model for a in tiny_lora.adapters]
    for i, output in enumerate(outputs):
        expected = hf_greedy(models[i % len(loras)], mixed_prompts[i], NUM_TOKENS)
        assert output.outputs[0].token_ids == expected, i
