"""A model whose every layer attends through a sliding window (Mistral-style) keeps only the
window's blocks: a long greedy generation equals HF transformers while the pool is far too
small to hold the whole context of even one sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM

transformers = pytest.importorskip("transformers")

WINDOW = 8
BLOCK_SIZE = 4
NUM_TOKENS = 60
PROMPT_LENS = (21, 30)
# 12 blocks of 4 tokens: 48 slots for two sequences of 81 and 90 tokens.
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    hf = transformers.MistralForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    path = tmp_path_factory.mktemp("mistral_window")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


GPU = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_long_generation_in_a_pool_smaller_than_the_context(
    mistral: tuple[Path, object], device: str
) -> None:
    """On CUDA the Triton kernels read the window through the holes' block ids."""
    path, hf = mistral
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(
        str(path),
        device=device,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=NUM_BLOCKS,
        enforce_eager=True,
    )
    try:
        assert llm.engine.scheduler.kv_cache_manager.sliding_window == WINDOW
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].finish_reason == "length"
        with torch.no_grad():
            theirs = hf.generate(  # type: ignore[attr-defined]
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert output.outputs[0].token_ids == theirs[0, len(prompt) :].tolist()
