"""Greedy correctness on the GPU against references (skipped without CUDA): SmolLM2 in fp32
on the GPU equals the CPU fp32 path token for token, and in bf16 it agrees with transformers
bf16 on the GPU at least as often as transformers bf16 agrees with transformers fp32.

Agreement is counted position by position up to each sequence's first divergence: after it
the two continue from different text, so later positions say nothing about the kernels."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from tests.conftest import PLAIN_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [*PLAIN_PROMPTS, "Two plus two equals", "The largest planet in the solar system is"]
NUM_TOKENS = 48


def engine_greedy(
    gguf: str, prompt_ids: list[list[int]], device: str, dtype: str
) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    llm = LLM(model=gguf, device=device, dtype=dtype)
    try:
        outputs = llm.generate(prompt_ids, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.close()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy decoding with the model's KV cache, EOS ignored as in the engine's runs."""
    device = next(model.parameters()).device
    result = []
    for ids in prompt_ids:
        inputs, past, tokens = torch.tensor([ids], device=device), None, []
        for _ in range(NUM_TOKENS):
            out = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            inputs = torch.tensor([[tokens[-1]]], device=device)
        result.append(tokens)
    return result


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions equal before each sequence's first divergence."""
    matched = 0
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x, y, strict=True):
            if p != q:
                break
            matched += 1
    return matched / sum(len(x) for x in a)


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm2) -> list[list[int]]:  # type: ignore[no-untyped-def]
    _, tokenizer = hf_smollm2
    return [tokenizer(p).input_ids for p in PROMPTS]


def test_fp32_gpu_equals_cpu_fp32(gguf_path, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    gpu = engine_greedy(str(gguf_path), prompt_ids, "cuda", "float32")
    cpu = engine_greedy(str(gguf_path), prompt_ids, "cpu", "float32")
    assert gpu == cpu


def test_bf16_gpu_agrees_with_transformers(gguf_path, hf_smollm2, prompt_ids) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_smollm2
    on_gpu = copy.deepcopy(model).to("cuda")
    hf_fp32 = hf_greedy(on_gpu, prompt_ids)
    hf_bf16 = hf_greedy(on_gpu.to(torch.bfloat16), prompt_ids)
    del on_gpu
    gc.collect()
    torch.cuda.empty_cache()
    ours = engine_greedy(str(gguf_path), prompt_ids, "cuda", "bfloat16")
    ours_vs_hf_bf16 = prefix_agreement(ours, hf_bf16)
    hf_bf16_vs_fp32 = prefix_agreement(hf_bf16, hf_fp32)
    print(
        f"bf16 on the GPU: asyncserve vs transformers bf16 {ours_vs_hf_bf16:.3f}; "
        f"transformers bf16 vs transformers fp32 {hf_bf16_vs_fp32:.3f}"
    )
    assert ours_vs_hf_bf16 >= hf_bf16_vs_fp32
