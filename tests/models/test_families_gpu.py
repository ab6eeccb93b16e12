"""On a GPU: tiny random models of the families whose attention runs rotary fused with the KV
store (and Qwen3's / Gemma 3's per-head norms in the same kernel) generate HF transformers'
greedy tokens in fp32, with CUDA graphs (decode replays) and chunked prefill. Skipped without
CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from tests.models.test_families import COMMON, NUM_TOKENS, VOCAB, _hf_greedy, save_tiny_family

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT_LENS = (5, 13, 21, 30)


def _save_tiny_qwen3(path: Path) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**COMMON, head_dim=32, intermediate_size=96)
    hf = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _near_tie(hf: Any, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Whether the first token where the two greedy runs part was a near-tie for HF (its
    logits for both choices within 1e-4): GPU sums round differently from the CPU's."""
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
    return bool((logits[theirs[at]] - logits[ours[at]]).abs() < 1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3", "granite"])
def test_gpu_greedy_matches_hf(name: str, tmp_path: Path) -> None:
    hf = _save_tiny_qwen3(tmp_path) if name == "qwen3" else save_tiny_family(name, tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(
        str(tmp_path),
        device="cuda",
        dtype="float32",
        max_num_batched_tokens=16,  # the longer prompts prefill in chunks
        kv_cache_memory=64 << 20,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.close()
    for prompt, output in zip(prompts, outputs, strict=True):
        ours, theirs = list(output.outputs[0].token_ids), _hf_greedy(hf, prompt)
        assert ours == theirs or _near_tie(hf, prompt, ours, theirs), (name, len(prompt))
