"""The image encoder's CUDA graphs (worker/encoder_graphs.py) on a GPU: a replay equals the
eager encoder for 1, 2 and 3 images (3 padded to the graph of 4), 5 images fall back to the
eager path, and greedy answers are the same with the graphs as with enforce_eager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams
from tests.multimodal.conftest import random_image

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="float32", max_model_len=256, kv_cache_memory=64 << 20,
        **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llava_gpu(tiny_llava_dir: Path) -> Iterator[LLM]:
    llm = _llm(tiny_llava_dir)
    yield llm
    llm.close()


def _items(llm: LLM, seeds: list[int]) -> list[Any]:
    engine: Any = llm._engine
    items = []
    for seed in seeds:
        mm = engine.multimodal.process(PROMPT, {"image": random_image(seed, 64, 48)})
        items += mm.features.items
    return items


@pytest.mark.parametrize("count", [1, 2, 3])
def test_replay_equals_eager(llava_gpu: LLM, count: int) -> None:
    runner: Any = llava_gpu._engine.runner  # type: ignore[attr-defined]
    graphs = runner.embedder.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    items = _items(llava_gpu, list(range(count)))
    with torch.inference_mode():
        replayed = graphs.encode_items(items)
        eager = runner.model.embed_images(items)
    assert replayed is not None and len(replayed) == count
    for got, want in zip(replayed, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_more_images_than_graphs_run_eagerly(llava_gpu: LLM) -> None:
    runner: Any = llava_gpu._engine.runner  # type: ignore[attr-defined]
    with torch.inference_mode():
        assert runner.embedder.graphs.encode_items(_items(llava_gpu, list(range(5)))) is None


def test_greedy_answers_equal_eager(llava_gpu: LLM, tiny_llava_dir: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": random_image(10 + i, 64, 48)}}
        for i in range(3)
    ]
    with_graphs = [o.outputs[0].token_ids for o in llava_gpu.generate(prompts, greedy)]
    eager_llm = _llm(tiny_llava_dir, enforce_eager=True)
    try:
        assert eager_llm._engine.runner.embedder.graphs is None  # type: ignore[attr-defined]
        eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, greedy)]
    finally:
        eager_llm.close()
    assert with_graphs == eager
