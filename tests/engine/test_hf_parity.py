"""Greedy outputs equal HF transformers token for token on the SmolLM2 GGUF (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from tests.conftest import PLAIN_PROMPTS

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", dtype="float32", kv_cache_memory=256 << 20)


def hf_greedy(hf_smollm2, prompt_ids: list[int], num_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    model, _ = hf_smollm2
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": p}]),
            add_special_tokens=False,
        )
        for p in PLAIN_PROMPTS
    ]


def test_greedy_plain_prompts_match_hf(llm: LLM, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(PLAIN_PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PLAIN_PROMPTS, outputs, strict=True):
        # The same ids through both engines.
        assert output.prompt_token_ids == hf_smollm2[1](prompt)["input_ids"]
        expected = hf_greedy(hf_smollm2, output.prompt_token_ids, NUM_TOKENS)
        assert output.outputs[0].token_ids == expected, prompt


def test_greedy_chat_prompts_match_hf(llm: LLM, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    prompts = chat_prompts(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for ids, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_smollm2, ids, NUM_TOKENS)


def test_chat_template_matches_hf(llm: LLM, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a color."},
    ]
    ours = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_smollm2[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs


def test_first_token_logprobs_match_hf(llm: LLM, hf_smollm2) -> None:  # type: ignore[no-untyped-def]
    model, _ = hf_smollm2
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    outputs = llm.generate(PLAIN_PROMPTS, params, use_tqdm=False)
    for output in outputs:
        with torch.no_grad():
            logits = model(torch.tensor([output.prompt_token_ids])).logits[0, -1]
        expected = torch.log_softmax(logits.float(), dim=-1)
        entry = output.outputs[0].logprobs[0]  # type: ignore[index]
        assert len(entry) >= 5
        for token_id, logprob in entry.items():
            assert abs(logprob.logprob - expected[token_id].item()) < 1e-3
        top = torch.topk(expected, 5).indices.tolist()
        assert set(top) <= set(entry)
        assert entry[output.outputs[0].token_ids[0]].rank == 1
