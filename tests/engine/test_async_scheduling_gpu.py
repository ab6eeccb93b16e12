"""Async scheduling on the GPU (skipped without CUDA): the next step reads the tokens of
the step in flight from the device, through the decode CUDA graphs, and the output is the
one of planning one step at a time.

Every request here runs to the same max_tokens with EOS ignored, so both modes build the
same batches step for step and bf16 results must match exactly. Uses the qwen3-0.6b
benchmark config with dummy weights: no model files needed on the device.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-0.6b"


def _generate(async_scheduling: bool, enforce_eager: bool) -> list[list[int]]:
    llm = LLM(
        model=str(CONFIG),
        load_format="dummy",
        device="cuda",
        max_model_len=512,
        gpu_memory_utilization=0.3,
        async_scheduling=async_scheduling,
        enforce_eager=enforce_eager,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(5, 120))] for _ in range(12)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))], use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    llm.close()
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_async_scheduling_matches_one_step_at_a_time(enforce_eager: bool) -> None:
    one_step = _generate(async_scheduling=False, enforce_eager=enforce_eager)
    assert _generate(async_scheduling=True, enforce_eager=enforce_eager) == one_step
