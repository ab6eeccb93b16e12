"""Speculative decoding on the GPU: Triton kernels, CUDA graphs for the steps without
proposals, the draft's pool on the device (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from tests.conftest import PLAIN_PROMPTS
from tests.spec_decode.test_ngram_engine import NGRAM, REPEATING

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = PLAIN_PROMPTS + REPEATING
PARAMS = SamplingParams(temperature=0.0, max_tokens=48)


def _greedy(gguf_path: Path, spec: dict[str, object] | None) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(gguf_path), device="cuda", dtype="float32", speculative_config=spec)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], llm


def _prefix_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions equal up to each pair's first divergence (after it the two go on
    from different text; fp32 kernels for 1 and k + 1 query rows may differ in the last bit)."""
    matched = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(y)
        for p, q in zip(x, y, strict=False):
            if p != q:
                break
            matched += 1
    return matched / total


def smollm2_eagle_head(gguf_path: Path, path: Path) -> str:
    """A random EAGLE-1 head with SmolLM2's shapes (no trained head exists for it)."""
    import json

    import transformers
    from safetensors.torch import save_file

    from asyncserve.models.gguf_loader import gguf_hf_config, open_gguf

    config = {**gguf_hf_config(open_gguf(gguf_path)), "num_hidden_layers": 1}
    torch.manual_seed(0)
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(
        transformers.LlamaConfig(**config), 0
    )
    hidden = config["hidden_size"]
    tensors = {"fc.weight": torch.randn(hidden, 2 * hidden) / (2 * hidden) ** 0.5}
    for name, tensor in layer.state_dict().items():
        if not name.startswith("input_layernorm."):
            tensors[f"layers.0.{name}"] = tensor.float().contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle"])
def test_gpu_greedy_with_speculation(gguf_path: Path, tmp_path: Path, method: str) -> None:
    expected, base = _greedy(gguf_path, None)
    base.close()
    spec = NGRAM if method == "ngram" else {"model": str(gguf_path), "num_speculative_tokens": 3}
    if method == "eagle":
        head = smollm2_eagle_head(gguf_path, tmp_path / "head")
        spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3}
    ours, llm = _greedy(gguf_path, spec)
    try:
        stats = llm.engine.scheduler.spec_stats
        print(f"{method}: acceptance {stats.acceptance_rate:.3f}, "
              f"mean accepted length {stats.mean_accepted_length:.2f}")  # fmt: skip
        assert stats.num_drafts > 0
        assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    finally:
        llm.close()
    assert _prefix_match(ours, expected) >= 0.95
