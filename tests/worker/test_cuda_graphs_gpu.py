"""Decode graphs on the GPU: every padded batch size is captured before the first request,
and replaying them gives the eager path's greedy tokens (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncserve import SamplingParams
from asyncserve.llm import LLM
from asyncserve.worker.cuda_graphs import capture_sizes
from tests.models.test_loader import random_state, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_every_size_is_captured_at_start_and_replays_equal_eager(tmp_path: Path) -> None:
    root = write_config(tmp_path / "llama")
    save_file(random_state(seed=5), str(root / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 9, 17, 5, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        llm = LLM(str(root), device="cuda", dtype="float32", max_num_seqs=24,
                  enforce_eager=eager, gpu_memory_utilization=0.2)  # fmt: skip
        try:
            runner = llm.engine.runner
            assert runner is not None
            if not eager:
                assert runner.decode_graphs is not None
                assert sorted(runner.decode_graphs.graphs) == capture_sizes(24)
            got = llm.generate(prompts, params, use_tqdm=False)
            outputs[eager] = [o.outputs[0].token_ids for o in got]
        finally:
            llm.close()
    assert outputs[False] == outputs[True]
