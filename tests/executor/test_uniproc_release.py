"""Closing an engine frees what its runner held on the device, even while the closed LLM is
still referenced (a later LLM in the same process needs that memory)."""

from __future__ import annotations

import torch

from asyncserve import SamplingParams
from asyncserve.llm import LLM

MODEL = "benchmarks/configs/llama-tiny"


def test_close_releases_weights_kv_cache_and_graphs() -> None:
    llm = LLM(MODEL, load_format="dummy", max_model_len=256, kv_cache_memory=1 << 20)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm._engine.runner
    assert runner is not None and runner.kv_caches
    llm.close()
    assert runner.kv_caches == [] and runner.decode_graphs is None and runner.proposer is None
    params = list(runner.model.parameters())
    assert params and all(p.device == torch.device("meta") for p in params)
    llm.close()  # a second close is harmless
