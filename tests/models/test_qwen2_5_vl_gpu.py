"""Qwen2.5-VL on the GPU (Triton kernels, fp32): greedy tokens equal to transformers' on CPU
with one and two images, whole and chunked prefill, decode steps through the captured CUDA
graphs (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve.llm import LLM
from tests.models.test_qwen2_5_vl import (  # noqa: F401 (fixtures)
    GREEDY,
    ONE,
    TWO,
    _hf_greedy,
    _process,
    hf_model,
    tiny_dir,
)
from tests.multimodal.conftest import random_image

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_gpu_greedy_equals_transformers(
    tiny_dir: Path,  # noqa: F811
    hf_model: Any,  # noqa: F811
    chunk: int | None,
) -> None:
    kwargs: dict[str, Any] = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(tiny_dir), device="cuda", dtype="float32", max_model_len=256, **kwargs)
    try:
        cases = [
            (ONE, [random_image(1, 100, 80)]),
            (TWO, [random_image(2, 60, 120), random_image(3, 130, 50)]),
        ]
        prompts = [{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for out, (prompt, imgs) in zip(outs, cases, strict=True):
            expected = _hf_greedy(hf_model, _process(llm, prompt, imgs))
            assert out.outputs[0].token_ids == expected
        runner = llm.engine.runner  # type: ignore[union-attr]
        assert runner is not None and runner.decode_graphs is not None
        assert runner.decode_graphs.graphs  # decode steps replayed captured graphs
    finally:
        llm.close()
