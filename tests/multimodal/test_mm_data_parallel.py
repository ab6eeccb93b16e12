"""Images with data parallelism on CPU: LLM(data_parallel_size=2) (two replica processes)
gives LLaVA and Qwen2.5-VL greedy tokens with one and two images equal to one engine's; the
front end processes the images and the replicas get the expanded prompts and pixel tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncserve.engine.dp_client import DataParallelClient
from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams
from tests.models.test_qwen2_5_vl import ONE as QWEN_ONE
from tests.models.test_qwen2_5_vl import TWO as QWEN_TWO
from tests.models.test_qwen2_5_vl import tiny_dir  # noqa: F401 (fixture)
from tests.multimodal.conftest import random_image
from tests.multimodal.test_llava import ONE as LLAVA_ONE
from tests.multimodal.test_llava import TWO as LLAVA_TWO

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARGS: dict[str, Any] = {"device": "cpu", "max_model_len": 256, "kv_cache_memory": 16 << 20}


def _prompts(one: str, two: str) -> list[Any]:
    a, b, c = random_image(1, 100, 80), random_image(2, 60, 120), random_image(3, 130, 50)
    return [
        {"prompt": one, "multi_modal_data": {"image": a}},
        {"prompt": two, "multi_modal_data": {"image": [b, c]}},
        {"prompt": one, "multi_modal_data": {"image": c}},
        {"prompt": two, "multi_modal_data": {"image": [c, a]}},
    ]


def _tokens(path: Path, dp: int, prompts: list[Any]) -> list[list[int]]:
    llm = LLM(str(path), data_parallel_size=dp, **ARGS)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        if dp > 1:
            client = llm.engine
            assert isinstance(client, DataParallelClient)
            assert all(n > 0 for n in client.balancer.num_chosen), client.balancer.num_chosen
    finally:
        llm.close()
    assert all(o.error is None for o in outs)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_dp2_greedy_equals_one_engine(
    family: str,
    tiny_llava_dir: Path,
    tiny_dir: Path,  # noqa: F811
) -> None:
    if family == "llava":
        path, prompts = tiny_llava_dir, _prompts(LLAVA_ONE, LLAVA_TWO)
    else:
        path, prompts = tiny_dir, _prompts(QWEN_ONE, QWEN_TWO)
    expected = _tokens(path, 1, prompts)
    assert _tokens(path, 2, prompts) == expected
    assert all(len(t) == GREEDY.max_tokens for t in expected)
