"""A random PEFT adapter on SmolLM2 (the default GGUF): greedy equals transformers + peft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncserve import LoRARequest, SamplingParams
from asyncserve.llm import LLM
from tests.conftest import PLAIN_PROMPTS
from tests.lora.conftest import hf_greedy, make_adapter

NUM_TOKENS = 8


def test_smollm2_adapter_matches_peft(hf_smollm2: Any, tmp_path: Path) -> None:
    model, _ = hf_smollm2
    adapter = make_adapter(
        model, tmp_path / "smol", 5, r=8, lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    )  # fmt: skip
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20,
              enable_lora=True, max_lora_rank=8)  # fmt: skip
    try:
        lora = LoRARequest("smol", 1, str(adapter.path))
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        prompts = PLAIN_PROMPTS[:2]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        base = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for output, plain in zip(outputs, base, strict=True):
        ids = output.prompt_token_ids
        assert output.outputs[0].token_ids == hf_greedy(adapter.model, ids, NUM_TOKENS)
        assert output.outputs[0].token_ids != plain.outputs[0].token_ids
